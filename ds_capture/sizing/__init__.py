"""The sizing stage: the ``ds-capture plan`` command: counting on meta, the memory model, the report."""
