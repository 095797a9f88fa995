"""Images and video for vision-language models: loading (no network), hashing, preprocessing, and the
prompt's image placeholders expanded to each image's tokens. Runs in the engine's process, never the
scheduler's: the scheduler gets each image as a preprocessed array and its hash (`io_struct.ImageInput`)."""
