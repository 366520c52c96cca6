"""The target stage: model families (the registry), checkpoint inputs, quantized schemes, loading."""
