"""The writing side of checkpoint conversion (`tpu-models export`): MaxText, Tunix and
PEFT checkpoints converted to HF safetensors (convert.py), written into a temporary
directory and renamed, or uploaded to gs:// behind tpu-models-export's markers
(hf_writer.py, gcs_upload.py). Readers live one level up (loaders/)."""
