"""A model split over ranks (tensor and pipeline parallelism, over one or several machines) behind the
scheduler's step-runner seam: rank 0 schedules and hands each step, as plain data, to every rank."""
