"""LightningModules of the presets and examples, and their networks (``components``), split as in
lightning-hydra-template."""
from lightning_topk.models.classifier import ImageClassifier
from lightning_topk.models.components import ResNet, SmallCNN, TransformerLM, resnet18, resnet50
from lightning_topk.models.language_model import LanguageModel

__all__ = ["ImageClassifier", "LanguageModel", "ResNet", "SmallCNN", "TransformerLM", "resnet18", "resnet50"]
