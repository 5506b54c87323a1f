"""DiLoCo Hub's algorithm library: model, data, inner loop, codec, wire format,
aggregation and outer step, and the in-process simulator. No HTTP, no SQL."""
