"""DiLoCo Hub server: the FastAPI app, one package per domain."""
