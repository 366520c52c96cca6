"""The parallel stage: launcher environment and process groups, the parallel layout, and the engines
that turn a plain model plus the layout into a frozen, sharded one."""
