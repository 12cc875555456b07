"""LightningCLI (jsonargparse) with the strategy by its registered name and by class path with options, in both
Lightning namespaces (tests/scripts/cli_fit.py, fast_dev_run, CPU); a bad option value names the option."""
import json

import pytest

from tests.helpers.procs import run_script

SCRIPT = "tests/scripts/cli_fit.py"
FAST = ["fit", "--trainer.accelerator=cpu", "--trainer.fast_dev_run=1", "--trainer.logger=false"]


@pytest.mark.parametrize("ns,devices,strategy,density,ddp", [
    ("pl", 2, ["--trainer.strategy=topk_ddp"], 0.01, {}),
    ("pl", 1, ["--trainer.strategy=lightning_topk.TopKDDPStrategy", "--trainer.strategy.init_args.density=0.02",
               "--trainer.strategy.init_args.find_unused_parameters=true"], 0.02, {"find_unused_parameters": "True"}),
    ("lightning", 1, ["--trainer.strategy=topk_ddp"], 0.01, {}),
    ("lightning", 1, ["--trainer.strategy=lightning_topk.UnifiedTopKDDPStrategy",
                      "--trainer.strategy.init_args.density=0.05"], 0.05, {}),
])
def test_lightning_cli_fits_with_the_strategy(tmp_path, ns, devices, strategy, density, ddp):
    out = tmp_path / "out.json"
    run_script([SCRIPT, *FAST, f"--trainer.devices={devices}", *strategy], env={"LIGHTNING_NS": ns, "CLI_OUT": str(out)})
    got = json.loads(out.read_text())
    assert got["class"] == ("TopKDDPStrategy" if ns == "pl" else "UnifiedTopKDDPStrategy")
    assert (got["density"], got["world"], got["steps"]) == (density, devices, 1)
    # torch DDP options the command line did not set are not passed (the strategy's own choice stays)
    assert got["ddp_kwargs"] == {**ddp, "gradient_as_bucket_view": "True"}


@pytest.mark.parametrize("option,message", [("density=abc", 'key "density"'),
                                            ("selector=nope", "selector must be one of")])
def test_lightning_cli_bad_option_value_is_named(tmp_path, option, message):
    with pytest.raises(AssertionError) as err:
        run_script([SCRIPT, *FAST, "--trainer.devices=1", "--trainer.strategy=lightning_topk.TopKDDPStrategy",
                    f"--trainer.strategy.init_args.{option}"], env={"LIGHTNING_NS": "pl"})
    assert message in str(err.value)
