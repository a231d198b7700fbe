"""Training checkpoints: the step directory and its manifest, the atomic writer, background saves, the save schedule, and the distributed model / optimizer state with its reshard across layouts."""
