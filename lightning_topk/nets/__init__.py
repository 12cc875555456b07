"""Models for the presets and examples: ResNet-18/50 (no torchvision), a causal Transformer LM, and
the LightningModules that train them."""
from lightning_topk.nets.classifier import ImageClassifier
from lightning_topk.nets.resnet import ResNet, resnet18, resnet50
from lightning_topk.nets.transformer import LanguageModel, TransformerLM

__all__ = ["ImageClassifier", "LanguageModel", "ResNet", "TransformerLM", "resnet18", "resnet50"]
