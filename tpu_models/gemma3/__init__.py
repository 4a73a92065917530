"""Gemma 3 (text): the model (model.py) and its checkpoint entry (checkpoints.py)."""
