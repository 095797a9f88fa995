"""Low-precision weights on the CPU: what the CPU can do (`cpu_features`), weight-only int8 / int4 linear
layers (`linear`), and a loaded model's linear layers swapped for them (`apply`)."""
