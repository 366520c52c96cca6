"""The capture stage: scoped hooks over one forward, progress, and the safety of long runs."""
