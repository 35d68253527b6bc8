"""A training run's own checkpoints: the DCP manager (save, resume, async, retention), its Stateful parts,
which checkpoint a run restores (``load_plan``), loading any format into a model, and the Hugging Face
folders written while training (``hf_save``)."""
