"""Hydra configs: every group option composes and builds; presets build and take two real steps with tiny
sizes; command-line overrides reach the objects; bad overrides fail with a clear message."""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_topk
from lightning_topk.app import resolvers as builders
from lightning_topk.app import train
from lightning_topk.data import ensure_digits_shards, write_shards
from lightning_topk.data.writer import encode_image
from lightning_topk.lightning.baselines import CompressedDDPStrategy, PowerSGDDDPStrategy
from lightning_topk.lightning.precision import TopKPrecision
from lightning_topk.models import LanguageModel, ResNet, TransformerLM
from lightning_topk.optim import LAMB, LARS
from tests.helpers.procs import ROOT

CONF = Path(resources.files("lightning_topk.conf"))
GROUPS = ["trainer", "strategy", "precision", "optimizer", "scheduler", "model", "data", "callbacks", "logger",
          "experiment"]


def options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture
def cfg_env(tmp_path, monkeypatch):
    """Compose with the packaged configs; shards go to a temporary cache; env and process group restored."""
    monkeypatch.setenv("LIGHTNING_TOPK_CACHE", str(tmp_path / "cache"))
    saved = dict(os.environ)
    with initialize_config_module("lightning_topk.conf", version_base="1.3"):
        yield lambda *ov: compose("config", overrides=[f"run.output_dir={tmp_path / 'run'}", *ov])
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)  # Lightning's launcher writes MASTER_PORT, LOCAL_RANK, WORLD_SIZE...


def test_every_group_has_options():
    for g in GROUPS:
        assert options(g), g
    assert {"topk_ddp", "topk_ddp_spawn", "ddp", "ddp_powersgd", "ddp_fp16"} <= set(options("strategy"))
    assert {"sgd", "adamw", "lars", "lamb"} == set(options("optimizer"))
    assert {"quick", "resnet50_imagenet", "transformer_lm"} <= set(options("experiment"))
    assert {"slurm", "local"} <= {p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml")}


@pytest.mark.parametrize("group", GROUPS)
def test_group_options_compose(cfg_env, group):
    for opt in options(group):
        cfg = cfg_env(f"{group}={opt}")
        assert OmegaConf.select(cfg, "trainer._target_") == "pytorch_lightning.Trainer"
        node = cfg.get(group) if group != "experiment" else cfg
        assert node is not None, (group, opt)
        if group in ("strategy", "precision", "model", "data", "optimizer", "trainer"):
            assert "_target_" in node, (group, opt)


def test_strategies_precisions_optimizers_instantiate(cfg_env):
    kinds = {"topk_ddp": lightning_topk.TopKDDPStrategy, "topk_ddp_spawn": lightning_topk.TopKDDPStrategy,
             "ddp": pl.strategies.DDPStrategy, "ddp_powersgd": PowerSGDDDPStrategy, "ddp_fp16": CompressedDDPStrategy}
    for name, cls in kinds.items():
        s = instantiate(cfg_env(f"strategy={name}").strategy)
        assert type(s) is cls, name
    assert instantiate(cfg_env("strategy=topk_ddp_spawn").strategy)._start_method == "spawn"
    for name, prec in {"32-true": "32-true", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}.items():
        p = instantiate(cfg_env(f"precision={name}", "precision.device=cpu").precision)
        assert isinstance(p, TopKPrecision) and p.precision == prec
        assert (p.scaler is not None) == (name == "16-mixed")
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    kinds = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "lars": LARS, "lamb": LAMB}
    for name, cls in kinds.items():
        opt = instantiate(cfg_env(f"optimizer={name}").optimizer)(net)
        assert type(opt) is cls, name
        decayed, excluded = opt.param_groups
        assert decayed["weight_decay"] > 0 and excluded["weight_decay"] == 0.0  # biases and BN: no decay
        assert len(decayed["params"]) == 2 and len(excluded["params"]) == 4
        if name in ("sgd", "adamw"):
            assert decayed["fused"] is True
    sched = instantiate(cfg_env("scheduler=warmup_cosine").scheduler)(opt, total_steps=100)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    base = 2.0e-3
    assert lrs[0] == pytest.approx(0.1 * base) and max(lrs) == pytest.approx(base) and lrs[-1] < 0.01 * base


def test_every_experiment_composes_with_every_strategy(cfg_env):
    """An experiment's top-k settings reach strategy=topk_ddp only (experiment_strategy/): under the default
    experiment, `strategy=topk_local` used to fail (its pinned exchange contradicts local_steps) and
    `strategy=ddp` handed DistributedDataParallel a `density` keyword."""
    from lightning_topk.comm import TopKConfig
    from lightning_topk.lightning.fsdp import TopKFSDPStrategy

    topk_keys = set(TopKConfig.option_names())
    for exp in options("experiment"):
        for name in options("strategy"):
            node = cfg_env(f"experiment={exp}", f"strategy={name}").strategy
            s = instantiate(node)  # TopKConfig validates here
            if isinstance(s, TopKFSDPStrategy):  # topk_ddp's options, DDP's own left out
                assert name.startswith("topk_fsdp") and s.topk_config.density == 0.01, (exp, name)
            elif not isinstance(s, lightning_topk.TopKDDPStrategy):
                assert not topk_keys & set(node), (exp, name, sorted(topk_keys & set(node)))
            elif name == "topk_ddp" and exp == "quick":
                assert s.topk_config.exchange == "allgather" and s.topk_config.min_sparse_numel == 4096
            if isinstance(s, lightning_topk.TopKDDPStrategy):
                # null in the config: the bucket rule picks the cap (no cap counts as the user's), and
                # gradients become views of DDP's buckets
                assert not s._topk_user_cap and "bucket_cap_mb" not in s._ddp_kwargs, (exp, name)
                s._configure_buckets(torch.nn.Linear(2, 2))
                assert s._ddp_kwargs["gradient_as_bucket_view"] is True, (exp, name)


def test_transformer_lm_fsdp_adamw_recipe_freezes_v_at_the_dense_steps(cfg_env):
    """experiment=transformer_lm_fsdp (strategy topk_fsdp): the per-step AdamW recipe (top-k of the update, dense
    steps, AdamW's v frozen when they end); the freeze follows strategy.dense_steps (one source of truth), and the
    recipe stays out of strategy=topk_fsdp_local."""
    from lightning_topk.optim import FrozenVarianceAdamW

    net = torch.nn.Linear(2, 2)
    for over, dense in ((), 100), (("strategy.dense_steps=30",), 30):
        cfg = cfg_env("experiment=transformer_lm_fsdp", *over)
        s = instantiate(cfg.strategy).topk_config
        assert (s.local_steps, s.outer_density, s.outer_value_bits, s.outer_recipe, s.dense_steps, s.outer_chunk) == (
            1, 0.01, 32, "average", dense, 0)
        opt = instantiate(cfg.optimizer)(net)
        assert type(opt) is FrozenVarianceAdamW and opt.param_groups[0]["freeze_variance_after"] == dense
        assert opt.param_groups[0]["beta1_after_freeze"] == 0.5
    with pytest.raises(ValueError, match="beta1_after_freeze"):  # no freeze: the beta1 change is refused, by name
        instantiate(cfg_env("experiment=transformer_lm_fsdp", "strategy.dense_steps=0").optimizer)(net)
    cfg = cfg_env("experiment=transformer_lm_fsdp", "strategy.dense_steps=0", "strategy.local_steps=0",
                  "optimizer.beta1_after_freeze=null")
    assert type(instantiate(cfg.optimizer)(net)) is torch.optim.AdamW
    cfg = cfg_env("experiment=transformer_lm_fsdp", "strategy=topk_fsdp_local")
    assert type(instantiate(cfg.optimizer)(net)) is torch.optim.AdamW and cfg.strategy.local_steps == 4


def test_default_config_builds_and_overrides_reach_objects(cfg_env, tmp_path):
    cfg = cfg_env("strategy.density=0.005", "strategy.selector=mstopk", "optimizer=lars", "optimizer.lr=0.3",
                  "trainer.max_epochs=3", "trainer.devices=1", "data.batch_size=16", "model.net.width=8",
                  "logger=tensorboard", "callbacks.lr_monitor=null")
    objs = train.build(cfg)
    trainer, model, dm = objs["trainer"], objs["model"], objs["datamodule"]
    assert isinstance(trainer.strategy, lightning_topk.TopKDDPStrategy)
    assert trainer.strategy.topk_config.density == 0.005 and trainer.strategy.topk_config.selector == "mstopk"
    assert trainer.max_epochs == 3 and trainer.num_devices == 1
    assert isinstance(trainer.precision_plugin, TopKPrecision) and trainer.precision_plugin.precision == "bf16-mixed"
    assert dm.batch_size == 16 and dm.ram_cache == "decoded"
    assert os.path.isfile(os.path.join(str(tmp_path / "cache"), os.listdir(tmp_path / "cache")[0], "splits.json"))
    assert model.net.features[0].out_channels == 8
    opt = model.optimizer_factory(model)
    assert isinstance(opt, LARS) and opt.param_groups[0]["lr"] == 0.3
    names = {type(c).__name__ for c in trainer.callbacks}
    assert {"ModelCheckpoint", "RichProgressBar", "ThroughputMonitor"} <= names and "LearningRateMonitor" not in names
    assert {type(lg).__name__ for lg in trainer.loggers} == {"CSVLogger", "TensorBoardLogger"}
    assert trainer.checkpoint_callback.dirpath == str(tmp_path / "run" / "checkpoints")
    assert str(trainer.default_root_dir) == str(tmp_path / "run")


def test_bad_overrides_fail_clearly(cfg_env):
    with pytest.raises(ConfigCompositionException, match="densty"):
        cfg_env("strategy.densty=0.1")
    with pytest.raises(Exception, match="Could not find 'strategy/nope'"):
        cfg_env("strategy=nope")
    with pytest.raises(InstantiationException, match=r"density must be a number in \(0, 1\], got 2"):
        instantiate(cfg_env("strategy.density=2").strategy)
    with pytest.raises(ValueError, match="option .name. must be one of"):
        instantiate(cfg_env("optimizer.name=adagrad").optimizer)(torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match="Missing mandatory value: data.train_shards"):
        instantiate(cfg_env("experiment=resnet50_imagenet").data)


def _fit_two_steps(cfg):
    """Build from the config and run 2 training steps + 1 val/test batch on 1 CPU process."""
    summary = train.run(cfg)
    assert summary["global_step"] == 2
    return summary


def _tiny(*ov):
    return ["trainer.devices=1", "trainer.accelerator=cpu", "trainer.max_steps=2", "trainer.limit_val_batches=1",
            "trainer.limit_test_batches=1", "trainer.num_sanity_val_steps=0", "trainer.enable_model_summary=false",
            "callbacks.progress_bar=null", "run.print_summary=false", "run.threads=null", *ov]


def test_quick_preset_runs(cfg_env):
    s = _fit_two_steps(cfg_env(*_tiny()))
    assert s["strategy"] == "topk_ddp" and 0.0 <= s["metrics"]["test/acc"] <= 1.0
    assert s["bytes"]["dense"] > 0 and os.path.isfile(s["checkpoint"])


def test_resnet50_imagenet_preset_runs_tiny(cfg_env, tmp_path):
    shards = ensure_digits_shards(str(tmp_path / "img"), image_size=32, num_shards=2)
    cfg = cfg_env(*_tiny("experiment=resnet50_imagenet", f"data.train_shards=[{','.join(shards['train'])}]",
                         f"data.val_shards=[{','.join(shards['val'])}]", "data.image_size=32", "data.batch_size=8",
                         "data.val_batch_size=8", "data.num_workers=0", "data.pin_memory=false", "data.crop_padding=4",
                         "model.net.width=4", "model.net.num_classes=10", "model.net.small_input=true",
                         "strategy.warmup_steps=0", "strategy.min_sparse_numel=64"))
    objs = train.build(cfg)
    model, trainer = objs["model"], objs["trainer"]
    assert isinstance(model.net, ResNet) and type(model.net.stages[0][0]).__name__ == "Bottleneck"
    assert model.label_smoothing == 0.1 and trainer.precision_plugin.precision == "16-mixed"
    assert trainer.strategy.topk_config.density == 0.001 and trainer.strategy.topk_config.value_dtype == "fp16"
    assert isinstance(model.optimizer_factory(model), LARS)
    s = _fit_two_steps(cfg)
    assert "val/acc" in s["metrics"]  # WebDataModule without a test split: the val metrics are reported


def test_transformer_lm_preset_runs_tiny(cfg_env, tmp_path):
    import json as real_text_source  # a real text: the source of a stdlib module, byte-level tokens

    text = Path(real_text_source.__file__).read_bytes()
    seq = 33
    tokens = np.frombuffer(text[: (len(text) // seq) * seq], dtype=np.uint8).reshape(-1, seq)
    samples = ({"__key__": f"{i:06d}", "npy": encode_image(t, "npy")} for i, t in enumerate(tokens[:64]))
    paths = write_shards(samples, str(tmp_path / "lm"), prefix="train", num_shards=2, total=64)
    cfg = cfg_env(*_tiny("experiment=transformer_lm", f"data.train_shards=[{','.join(paths)}]",
                         f"data.val_shards=[{paths[0]}]", "data.batch_size=4", "data.num_workers=0",
                         "model.net.d_model=32", "model.net.layers=2", "model.net.heads=4", "model.net.max_len=64",
                         "strategy.min_sparse_numel=64"))
    objs = train.build(cfg)
    assert isinstance(objs["model"], LanguageModel) and isinstance(objs["model"].net, TransformerLM)
    assert isinstance(objs["model"].optimizer_factory(objs["model"]), LAMB)
    s = _fit_two_steps(cfg)
    assert 0.0 < s["metrics"]["val/loss"] < 10.0


def test_resolvers_cache_dir_and_devices(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_TOPK_CACHE", str(tmp_path / "c"))
    assert builders.cache_dir() == str(tmp_path / "c")
    assert builders.cache_dir("~/x") == os.path.expanduser("~/x")
    monkeypatch.delenv("LIGHTNING_TOPK_CACHE")
    assert builders.cache_dir() == os.path.expanduser("~/.cache/lightning_topk")
    assert builders.default_devices(2) == (torch.cuda.device_count() if torch.cuda.is_available() else 2)


def test_topk_strategy_config_lists_every_option():

    import yaml

    from lightning_topk.comm.state import TopKConfig

    cfg = yaml.safe_load((ROOT / "conf" / "strategy" / "topk_ddp.yaml").read_text())
    missing = set(TopKConfig.option_names()) - set(cfg)
    assert not missing, f"conf/strategy/topk_ddp.yaml lacks {sorted(missing)}"


def test_options_page_table_is_topk_config():
    """The options page's TopKDDPStrategy table (docs/options.md) lists exactly TopKConfig's fields, with their
    defaults, and the docstring of the option group that defines each (StepOptions, AutoOptions, OuterOptions,
    FaultOptions: TopKConfig's bases) documents it."""
    import dataclasses
    import re

    from lightning_topk.comm.state import TopKConfig

    text = (ROOT / "docs" / "options.md").read_text()
    table = text.split("\n## `TopKDDPStrategy` options\n\n", 1)[1].split("\n\n", 1)[0]
    assert table.startswith("| option | default | allowed | meaning |"), table[:200]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", table, flags=re.M))
    fields = {f.name: f.default for f in dataclasses.fields(TopKConfig)}
    assert set(rows) == set(fields), (sorted(set(rows) ^ set(fields)))
    for name, default in fields.items():
        assert rows[name] == repr(default).replace("'", '"'), (name, rows[name], default)
        # documented in the docstring of the option group (TopKConfig's base) that defines it
        group = next(c for c in TopKConfig.__mro__ if name in c.__dict__.get("__annotations__", {}))
        assert group is not TopKConfig, f"{name} is defined outside the option groups"
        assert re.search(rf"^\s+{name}: ", group.__doc__ or "", flags=re.M), f"{group.__name__} docstring lacks {name}"


def test_topk_fsdp_takes_fault_tolerance(cfg_env):
    """strategy=topk_fsdp (and topk_fsdp_local) strategy.fault_tolerance=torchft: the Trainer's sharded strategy
    under torchft (docs/elastic.md); streaming local SGD is refused under torchft, naming the option."""
    from lightning_topk.lightning.fsdp import TopKFSDPStrategy

    s = instantiate(cfg_env("strategy=topk_fsdp", "strategy.fault_tolerance=torchft", "strategy.min_replicas=2").strategy)
    assert isinstance(s, TopKFSDPStrategy) and s.topk_config.elastic and s.topk_config.min_replicas == 2
    s = instantiate(cfg_env("strategy=topk_fsdp_local", "strategy.fault_tolerance=torchft").strategy)
    assert s.topk_config.elastic and s.topk_config.local_steps == 16
    with pytest.raises(InstantiationException, match="outer_streaming=false"):
        instantiate(cfg_env("strategy=topk_fsdp_local", "strategy.fault_tolerance=torchft",
                            "strategy.outer_streaming=true").strategy)
