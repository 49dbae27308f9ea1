"""The plan before the GPU: a training step at real size on fake tensors (`dry_run`), the configurations it compares
and the table a person reads (`plan`), the devices it plans for (`devices`), and `memopt-plan` (`cli`)."""
