"""The parts a run is built from, each from its config section: the model (models.py; causal
language models in lm_models.py, Hugging Face's by type in hf_models.py), the datasets (data.py;
the image datasets in images/, the text datasets in text/), the DataLoaders over them
(loaders.py), the loss (losses.py), and the optimizer with its LR schedule (optim.py). Each
builder takes its section and returns plain PyTorch objects: nothing here knows the precision
level, the trainer or the tracking store."""
