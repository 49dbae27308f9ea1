"""Apply: run each layer under its policy (the engine, the saved-tensor hooks and their recipes, whole-layer
checkpoint, the tracker that sees each op), and step one's recording into the measure package's forms."""
