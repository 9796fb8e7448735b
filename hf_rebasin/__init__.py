"""hf-rebasin: align, merge and transport Hugging Face Transformers across their symmetries."""

__version__ = "0.1.0"
