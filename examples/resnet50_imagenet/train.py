"""ResNet-50 / ImageNet shards without Hydra: LARS + warm-up/cosine + label smoothing + fp16 + topk_ddp.

Make the shards first (see README.md next to this file). Run ``python train.py --help`` for options.
"""
import argparse

import pytorch_lightning as pl

import lightning_topk  # noqa: F401  (registers topk_ddp)
from lightning_topk import TopKDDPStrategy
from lightning_topk.app.factories import optimizer, warmup_cosine
from lightning_topk.data import WebDataModule
from lightning_topk.lightning.precision import TopKPrecision
from lightning_topk.models import ImageClassifier, resnet50


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--train", required=True, help="train shards, e.g. '/data/wds/train-{000000..000599}.tar'")
    ap.add_argument("--val", default=None, help="val shards")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=256, help="per process")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--lr", type=float, default=None, help="LARS lr; default 9.0 x global batch / 8192")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args()

    global_batch = a.batch_size * a.devices * a.nodes
    lr = a.lr if a.lr is not None else 9.0 * global_batch / 8192
    dm = WebDataModule(a.train, val_shards=a.val, keys=("jpg;jpeg;png", "cls"), image_mode="RGB", image_size=224,
                       batch_size=a.batch_size, num_workers=a.workers, drop_last=True, crop_padding=16, flip=True,
                       mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], persistent_workers=True,
                       pin_memory=True, on_bad_sample="skip")
    model = ImageClassifier(
        resnet50(num_classes=1000, zero_init_residual=True), label_smoothing=0.1, num_classes=1000,
        optimizer=lambda m: optimizer(m, name="lars", lr=lr, momentum=0.9, weight_decay=5e-5),
        scheduler=lambda opt, total_steps: warmup_cosine(opt, total_steps, warmup_fraction=0.05),
    )
    strategy = TopKDDPStrategy(density=a.density, selector="mstopk", value_dtype="fp16", dense_steps=2,
                               warmup_steps=2000, warmup_start=0.25, nonfinite="skip")
    trainer = pl.Trainer(accelerator="gpu", devices=a.devices, num_nodes=a.nodes, strategy=strategy,
                         plugins=[TopKPrecision("16-mixed")], max_epochs=a.epochs, log_every_n_steps=50,
                         callbacks=[pl.callbacks.RichProgressBar(), pl.callbacks.LearningRateMonitor("step"),
                                    pl.callbacks.ModelCheckpoint(save_last=True)])
    trainer.fit(model, datamodule=dm)


if __name__ == "__main__":
    main()
