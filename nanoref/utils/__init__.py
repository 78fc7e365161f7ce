"""Per-step context, model loading and shape tracing."""
