"""Pure PyTorch models: attention kinds, embeddings, the transformer. No Ray, no MLflow, no file I/O."""

from models.classifier import SequenceClassifier
from models.config import ModelConfig
from models.transformer import LanguageModel, Seq2SeqTransformer, checkpoint_activations

__all__ = ["LanguageModel", "ModelConfig", "Seq2SeqTransformer", "SequenceClassifier", "checkpoint_activations"]
