"""Models larger than one device: tensor parallelism (:mod:`quickdraft.parallel.tp`) and its launcher."""
