"""The executor wing: how a step runs on a device. The model runner builds the model, sizes the KV pool,
runs forwards (CUDA graphs on a GPU) and samples; the loader reads weights. It never imports the
scheduler or the engine."""
