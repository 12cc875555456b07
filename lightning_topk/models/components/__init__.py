"""Plain ``nn.Module`` networks (no Lightning): the small CNN, ResNet-18/50 (no torchvision), a causal Transformer LM."""
from lightning_topk.models.components.resnet import ResNet, resnet18, resnet50
from lightning_topk.models.components.small_cnn import SmallCNN
from lightning_topk.models.components.transformer import TransformerLM

__all__ = ["ResNet", "SmallCNN", "TransformerLM", "resnet18", "resnet50"]
