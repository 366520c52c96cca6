"""The recipe stage: a YAML recipe (+ DeepSpeed JSON) -> a validated, frozen ``RunConfig``."""
