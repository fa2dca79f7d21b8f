"""Export: loads in a process without hybrid_scale/peft/deepspeed (trust_remote_code), equals the toolkit's model,
streamed LoRA merge == PEFT's merge_and_unload, reloads into hybrid_scale, clear errors on a missing or corrupt
shard, inference-time hybridisation with fixed and calibrated gamma, the cache of exact keys and its per-head budgets.
(Over 500 lines: its tests share the module-scoped exported model and the isolated-process loader, which is what
keeps them fast; splitting the file would build the export once per file.)"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import perturb_hybrid, save_stage2_like, tiny_model
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import hybrid_scale as hs
from hybrid_scale.config import load_config
from hybrid_scale.errors import ConfigError, ExportError
from hybrid_scale.evaluate.results import EvalResults
from hybrid_scale.export import stage as export_stage
from hybrid_scale.export.stage import export
from hybrid_scale.models.convert import set_cache
from hybrid_scale.models.converted import ADAPTER_DIR
from hybrid_scale.preflight.inputs import InputError
from hybrid_scale.storage.commits import MARKER, PARTIAL_TAG

ISOLATED = r"""
import json, sys
for name in ("hybrid_scale", "peft", "deepspeed"):
    sys.modules[name] = None  # import blocker: importing any of them raises ImportError
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
path, out = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)  # as the model card says: no remote code
print("TOKENIZER LOADED", flush=True)
try:
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    refused = ""
except Exception as e:
    refused = f"{type(e).__name__}: {e}"
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
ids = torch.load(sys.argv[3])
mask = torch.ones_like(ids)
mask[1, :5] = 0  # left padding in the second row
with torch.no_grad():
    logits = model(ids).logits
    padded = model(ids, attention_mask=mask).logits
gen = model.generate(ids[:1], max_new_tokens=20, do_sample=False)
# the decode step compiled (fullgraph) with the export's own cache class: the same tokens, one graph
import importlib
from torch._dynamo.utils import counters
from transformers.generation.configuration_utils import CompileConfig
cache_class = importlib.import_module(type(model).__module__.rsplit(".", 1)[0] + ".cache").HybridCache
config = CompileConfig(fullgraph=True)
config._compile_all_devices = True
with torch._dynamo.config.patch(error_on_recompile=True):
    compiled = model.generate(ids[:1], max_new_tokens=20, do_sample=False, cache=cache_class(model),
                              compile_config=config)
graphs = counters["stats"]["unique_graphs"]
model.set_hybrid_mode("la_only")
with torch.no_grad():
    la_only = model(ids).logits
model.set_hybrid_mode("hybrid")
model.set_hybrid_cache(4, "self_recall")  # the cache of exact keys, set at load time: its decode in the remote code
cached_gen = model.generate(ids[:1], max_new_tokens=20, do_sample=False)
torch.save({"logits": logits, "padded": padded, "gen": gen, "la_only": la_only, "compiled": compiled, "graphs": graphs,
            "cached_gen": cached_gen,
            "tokens": tokenizer("The hybrid model reads this.")["input_ids"]}, out)
print("\nRESULT", json.dumps({"refused": refused, "class": type(model).__name__,
                  "imported": [n for n in ("hybrid_scale", "peft", "deepspeed") if sys.modules.get(n) is not None]}))
"""


@pytest.fixture(scope="module")
def trained(smollm2, tmp_path_factory):
    """A stage-2-like model: tiny Llama (2 shards) converted, perturbed phi/gamma, and a random LoRA adapter."""
    root = tmp_path_factory.mktemp("export")
    base = root / "base"
    model = tiny_model("llama", vocab_size=49152, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model.save_pretrained(base, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(smollm2.model).save_pretrained(base)
    assert len(list(base.glob("model-*.safetensors"))) >= 2
    # the remote code runs the sinks and the LA's decay too
    save_stage2_like(model, root / "stage2_best", base, hybrid_sinks=True, la_decay=True)
    docs = smollm2.train_text.read_text().split("\n\n")[:300]
    (root / "text.txt").write_text("\n\n".join(docs))
    return root


def cfg(root: Path, out: Path, *extra):
    return load_config(
        overrides=[
            f"export.model={root / 'stage2_best'}",
            f"export.out_dir={out}",
            f"data.source={root / 'text.txt'}",
            "export.calibration_sequences=2",
            "export.calibration_seq_len=64",
            "export.calibration_steps=20",
            "export.report_sequences=2",
            "export.report_seq_len=64",
            "eval.buckets=[0,8,32]",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "export"
    export(cfg(trained, out, "export.max_shard_gb=0.002"))
    return out


def ids():
    return torch.randint(3, 49152, (2, 40), generator=torch.Generator().manual_seed(1))


def test_export_layout(exported):
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert "hybrid_params.safetensors" in files and len(files) >= 3  # shards capped at 2 MB + the hybrid shard
    for f in files - {"hybrid_params.safetensors"}:  # at most 2 MB, unless one tensor alone is larger
        names = [k for k, v in index["weight_map"].items() if v == f]
        assert len(names) == 1 or (exported / f).stat().st_size <= 2_000_000
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "hybrid_scale_llama" and config["hybrid"]["window"] == 8
    assert config["hybrid"]["hybrid_sinks"] is True and config["hybrid"]["sinks"] == 8
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_hybrid_scale.HybridScaleLlamaForCausalLM"
    assert (exported / MARKER).is_file() and (exported / "tokenizer.json").is_file()
    assert "trust_remote_code=True" in (exported / "README.md").read_text()
    assert not list(exported.parent.glob("*.partial"))


def test_export_holds_the_attention_folder(exported):
    """The code copied is what hybrid_scale/attention holds (every module, flattened as export/remote_code.py writes
    it: the same source with its relative imports made flat), not a hand-kept list."""
    from hybrid_scale.export.remote_code import flat_name, remote_code

    folder = Path(hs.__file__).parent / "attention"
    parts = [p.relative_to(folder).with_suffix("").parts for p in folder.rglob("*.py") if p.name != "__init__.py"]
    modules = {flat_name(m) + ".py" for m in parts}
    assert {"backends.py", "hedgehog_naive.py", "hedgehog_chunk.py", "layer.py", "modeling_hybrid_scale.py"} <= modules
    assert {p.name for p in exported.glob("*.py")} == modules
    for name, text in remote_code().items():
        assert (exported / name).read_text() == text, name


def test_isolated_process_loads_it_and_matches_the_toolkit(trained, exported, tmp_path):
    copy = shutil.copytree(exported, tmp_path / "moved")  # nothing points back at the run
    info, got = load_alone(copy, tmp_path)
    assert info["class"] == "HybridScaleLlamaForCausalLM" and info["imported"] == []
    assert "trust_remote_code" in info["refused"]  # no silent softmax model
    assert_matches(got, hs.load_converted(trained / "stage2_best", dtype=torch.float32))  # base + phi/gamma + LoRA
    assert torch.equal(got["compiled"], got["gen"]) and got["graphs"] == 1  # compiled decoding of the export
    # the tokenizer: the base model's, loaded without remote code and without transformers asking about it
    assert got["tokens"] == AutoTokenizer.from_pretrained(trained / "base")("The hybrid model reads this.")["input_ids"]
    assert "Do you wish to run the custom code" not in info["stdout"].split("TOKENIZER LOADED")[0]  # no prompt


def test_streamed_merge_equals_peft_merge_and_unload(trained, exported):
    plain = AutoModelForCausalLM.from_pretrained(trained / "base", dtype=torch.float32)
    merged = PeftModel.from_pretrained(plain, trained / "stage2_best" / ADAPTER_DIR).merge_and_unload().state_dict()
    index = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    ours = {}
    for file in set(index.values()) - {"hybrid_params.safetensors"}:
        ours.update(load_file(exported / file))
    base = load_base(trained)
    assert set(ours) == set(base)  # the base checkpoint's tensors, re-sharded
    changed = [k for k in ours if not torch.equal(ours[k], base[k])]
    assert sorted(changed) == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qvo")
    for k, v in ours.items():
        assert torch.allclose(v, merged[k], atol=1e-6), k


def load_base(trained):
    out = {}
    for f in (trained / "base").glob("model-*.safetensors"):
        out.update(load_file(f))
    return out


def test_export_loads_back_into_hybrid_scale(trained, exported, capfd):
    again = hs.load_converted(exported, dtype=torch.float32)
    ref = hs.load_converted(trained / "stage2_best", dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(again(ids()).logits, ref(ids()).logits, atol=1e-5)
    # the export's shards also hold phi/gamma: loading its softmax base must not report them as unexpected keys
    out = capfd.readouterr()
    assert "UNEXPECTED" not in out.out + out.err and "gamma_logit" not in out.out + out.err
    assert LlamaForCausalLM._keys_to_ignore_on_load_unexpected is None  # the loader's exception is undone


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_missing_or_corrupt_input_shard(trained, tmp_path, damage):
    broken = shutil.copytree(trained, tmp_path / "broken")
    meta = json.loads((broken / "stage2_best" / "hybrid_config.json").read_text())
    meta["base_model"] = str(broken / "base")
    (broken / "stage2_best" / "hybrid_config.json").write_text(json.dumps(meta))
    shard = sorted((broken / "base").glob("model-*.safetensors"))[-1]
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:100])
    out = tmp_path / "out" / "export"
    with pytest.raises(InputError) as e:  # found by the input checks, before anything is written
        export(cfg(broken, out))
    if damage == "missing":
        assert str(e.value).startswith(f"{broken / 'base'}: shard(s) named in its index are missing: {shard.name}")
    else:
        assert str(e.value).startswith(f"{shard} is not a readable safetensors file")
    assert "restore the checkpoint's files" in str(e.value)
    assert not out.exists() and not out.with_name("export.partial").exists()  # nothing that looks like an export


def test_a_previous_export_is_replaced_and_nothing_is_left_beside_it(trained, tmp_path):
    out = tmp_path / "export"
    export(cfg(trained, out, "export.gamma=0.3", "export.report_sequences=0"))
    (out.with_name("export.partial")).mkdir()  # a crashed export's leftover, tagged as the toolkit's
    (out.with_name("export.partial") / PARTIAL_TAG).write_text("")
    export(cfg(trained, out, "export.gamma=0.7", "export.report_sequences=0"))
    gammas = [v for k, v in load_file(out / "hybrid_params.safetensors").items() if k.endswith("gamma_logit")]
    assert all(torch.allclose(torch.sigmoid(g), torch.full_like(g, 0.7)) for g in gammas)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def evaluation_of(model: Path) -> str:
    """results.json of an evaluation of `model` that measured nothing."""
    return EvalResults(
        model=str(model), converted=True, untrained_feature_maps=False, window=16, sinks=0, hybrid_sinks=False,
        la_decay=False, world_size=1, tensor_parallel=1, config={}, identity={}, heldout=None, tasks={}, modes={},
        timings_s={},
    ).dumps()  # fmt: skip


def test_the_card_names_its_checkpoint_and_takes_only_its_own_balance_table(trained, tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "table.md").write_text("| mode | avg |\n|---|---|\n| hybrid | 0.5 |\n")
    source = (trained / "stage2_best").resolve()
    for evaluated, included in ((trained / "base", False), (source, True)):
        (run / "eval" / "results.json").write_text(evaluation_of(evaluated))
        out = export(cfg(trained, tmp_path / f"out_{included}", f"run_dir={run}"))
        card = (out / "README.md").read_text()
        assert f"Exported from {trained.name}/stage2_best." in card  # its parent and name (no stage-2 step here)
        assert (f"## Balance report (component ablation of {trained.name}/stage2_best)" in card) == included
        assert (out / "balance" / "table.md").is_file() == included
        log = (out / "export_log.txt").read_text()
        assert (f"describes {(trained / 'base').resolve()}, not the exported {source}: left out" in log) != included


def test_inference_time_hybridisation_fixed_and_calibrated(trained, tmp_path):
    # an LA-only model: stage 2 trained in la_only; the export adds SWA back with gamma fixed or calibrated
    meta = json.loads((trained / "stage2_best" / "hybrid_config.json").read_text())
    la = shutil.copytree(trained, tmp_path / "la")
    meta["attention"]["mode"] = "la_only"
    (la / "stage2_best" / "hybrid_config.json").write_text(json.dumps(meta))
    fixed = export(cfg(la, tmp_path / "fixed", "export.mode=hybrid", "export.gamma=0.3", "export.report_sequences=0"))
    gammas = [v for k, v in load_file(fixed / "hybrid_params.safetensors").items() if k.endswith("gamma_logit")]
    assert all(torch.allclose(torch.sigmoid(g), torch.full_like(g, 0.3)) for g in gammas)
    assert "perplexity" not in json.loads((fixed / "gamma_report.json").read_text())  # report_sequences=0: none
    card = (fixed / "README.md").read_text()
    assert "gamma fixed at 0.3 for every head." in card and "held-out perplexity" not in card
    assert json.loads((fixed / "config.json").read_text())["hybrid"]["mode"] == "hybrid"

    calibrated = export(cfg(la, tmp_path / "cal", "export.mode=hybrid", "export.calibrate_gamma=true"))
    report = json.loads((calibrated / "gamma_report.json").read_text())
    for before, after in report["calibration_mse"].values():
        assert after < before  # the fit moved gamma towards full softmax
    assert {"hybrid (as trained)", "hybrid (calibrated)", "swa_only", "la_only"} <= set(report["perplexity"])
    assert "Inference-time gamma" in (calibrated / "README.md").read_text()
    model = hs.load_converted(calibrated, dtype=torch.float32)
    assert {m.mode for m in model.modules() if isinstance(m, hs.HybridAttention)} == {"hybrid"}


@pytest.mark.parametrize(
    "extra, short",
    [
        (["export.calibrate_gamma=true", "export.calibration_sequences=100000"], "export.calibration_sequences x"),
        (["export.gamma=0.3", "export.report_sequences=100000"], "export.report_sequences x"),
        (["export.gamma=0.3", "data.heldout_fraction=0"], "export.report_sequences x"),
    ],
)
def test_too_little_text_for_a_calibration_or_its_report_is_refused_before_anything_is_written(
    trained, tmp_path, monkeypatch, extra, short
):
    out = tmp_path / "export"
    monkeypatch.setattr(export_stage, "write_shards", lambda *a, **k: pytest.fail("a shard was written first"))
    with pytest.raises(ExportError, match=rf"the export's text for {short}.* falls short: "):
        export(cfg(trained, out, "export.mode=hybrid", *extra))
    assert list(tmp_path.iterdir()) == []  # no shard, no partial directory


def test_a_gamma_is_refused_where_it_cannot_act_and_taken_where_the_models_parametrisation_reaches_it(
    trained, tmp_path
):
    meta = json.loads((trained / "stage2_best" / "hybrid_config.json").read_text())
    la = shutil.copytree(trained, tmp_path / "la")
    (la / "stage2_best" / "hybrid_config.json").write_text(
        json.dumps(meta | {"attention": meta["attention"] | {"mode": "la_only"}})
    )
    with pytest.raises(ExportError, match="runs la_only, where gamma has no effect: set export.mode=hybrid"):
        export(cfg(la, tmp_path / "out", "export.calibrate_gamma=true"))
    with pytest.raises(ExportError, match=r"gamma': must be in \(0, 1\) with attention.gamma_param=sigmoid, got 1.5"):
        export(cfg(trained, tmp_path / "out", "export.gamma=1.5", "export.report_sequences=0"))
    assert not (tmp_path / "out").exists()
    exp = shutil.copytree(trained, tmp_path / "exp")  # gamma = exp(logit): any gamma > 0
    (exp / "stage2_best" / "hybrid_config.json").write_text(
        json.dumps(meta | {"attention": meta["attention"] | {"gamma_param": "exp"}})
    )
    out = export(cfg(exp, tmp_path / "out", "export.gamma=1.5", "export.report_sequences=0"))
    gammas = [v for k, v in load_file(out / "hybrid_params.safetensors").items() if k.endswith("gamma_logit")]
    assert gammas and all(torch.allclose(g.exp(), torch.full_like(g, 1.5)) for g in gammas)


def test_an_export_is_not_exported_again(trained, exported, tmp_path):
    with pytest.raises(ConfigError, match=r"is an export already \(HybridScaleLlamaForCausalLM\); export from the"):
        export(cfg(trained, tmp_path / "again", f"export.model={exported}"))
    assert not (tmp_path / "again").exists()


PIQA_YAML = """task: piqa_local
dataset_path: arrow
dataset_kwargs:
  data_files:
    validation: {arrow}
output_type: multiple_choice
validation_split: validation
doc_to_text: "Question: {{{{goal}}}}\\nAnswer:"
doc_to_target: label
doc_to_choice: "{{{{[sol1, sol2]}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


@pytest.mark.slow
def test_lm_evaluation_harness_runs_the_export_with_our_logliks(smollm2, tmp_path, monkeypatch):
    """SmolLM2 converted (window 16, so LA matters), exported, scored by lm-eval's `hf` model with remote code on
    local arrow data: per-item log-likelihoods equal our evaluator's."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from hybrid_scale.evaluate.stage import evaluate

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    model = AutoModelForCausalLM.from_pretrained(smollm2.model, dtype=torch.float32)
    perturb_hybrid(hs.convert_model(model, {"window": 16}), scale=0.05)
    hs.save_converted(model, tmp_path / "converted", base_path=smollm2.model)
    out = export(load_config(overrides=[f"export.model={tmp_path / 'converted'}", f"export.out_dir={tmp_path / 'x'}"]))
    (tmp_path / "tasks").mkdir()
    arrow = next((smollm2.datasets / "piqa").glob("*.arrow"))
    (tmp_path / "tasks" / "piqa_local.yaml").write_text(PIQA_YAML.format(arrow=arrow))
    n = 8  # 16 per-choice log-likelihoods, each compared (20 items took 63 s of the suite)
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},trust_remote_code=True,dtype=float32",
        tasks=["piqa_local"],
        task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        limit=n,
        batch_size=4,
        log_samples=True,
        device="cpu",
    )
    theirs = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in res["samples"]["piqa_local"]}
    results = evaluate(
        load_config(
            overrides=[
                f"eval.model={out}",
                "eval.tasks=[piqa]",
                f"eval.limit={n}",
                "eval.modes=[hybrid]",
                "eval.ppl_sequences=0",
                "eval.passkey_trials=0",
                "eval.bootstrap=0",
                "eval.progress=false",
                f"run_dir={tmp_path / 'run'}",
            ]
        )
    )
    ours = results.modes["hybrid"].tasks["piqa"].loglik
    assert sorted(theirs) == list(range(n))
    assert torch.allclose(torch.tensor([theirs[i] for i in range(n)]), torch.tensor(ours), atol=1e-3, rtol=0)


def load_alone(export_dir: Path, tmp_path: Path) -> tuple[dict, dict]:
    """ISOLATED run on an export in a process of its own: (its RESULT line with its whole stdout, the tensors it
    saved)."""
    torch.save(ids(), tmp_path / "ids.pt")
    (tmp_path / "load.py").write_text(ISOLATED)
    proc = subprocess.run(
        [sys.executable, "-I", "load.py", str(export_dir), str(tmp_path / "out.pt"), str(tmp_path / "ids.pt")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = {**json.loads(proc.stdout.split("RESULT", 1)[1]), "stdout": proc.stdout}
    return info, torch.load(tmp_path / "out.pt")


def assert_matches(got: dict, ref) -> None:
    """An export's results (load_alone) equal the toolkit's model `ref`: logits, padding, la_only, greedy tokens."""
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    with torch.no_grad():
        assert torch.allclose(got["logits"], ref(x).logits, atol=1e-5)
        assert torch.allclose(got["padded"], ref(x, attention_mask=mask).logits, atol=1e-5)
        with hs.components(ref, "la_only"):
            assert torch.allclose(got["la_only"], ref(x).logits, atol=1e-5)
    assert torch.equal(got["gen"], ref.generate(x[:1], max_new_tokens=20, do_sample=False))
    set_cache(ref, 4, "self_recall")  # the remote code decodes with the cache of exact keys as the toolkit does
    assert torch.equal(got["cached_gen"], ref.generate(x[:1], max_new_tokens=20, do_sample=False))
    set_cache(ref, 0)


@pytest.fixture(scope="module")
def trained_delta(smollm2, trained, tmp_path_factory):
    """The same stage-2-like model with the gated delta-rule LA (its gates and a short convolution, the own sinks)."""
    root = tmp_path_factory.mktemp("export_delta")
    model = tiny_model("llama", vocab_size=49152, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    save_stage2_like(model, root / "stage2_best", trained / "base", hybrid_sinks=True, la_kind="gated_delta", la_conv=4,
                     la_combine="mix", la_qk_map=True)  # fmt: skip
    shutil.copy(trained / "text.txt", root / "text.txt")
    return root


def test_gated_delta_export_runs_its_remote_code_alone_and_matches_the_toolkit(trained_delta, tmp_path):
    """The export's remote code (torch only) runs the gated delta rule with the cache of exact keys the run asks for
    (4 keys per KV head by the delta rule's own residual; the converted model was made without one): logits,
    padding, la_only, greedy and compiled generation equal the toolkit's model with the same cache."""
    out = tmp_path / "export"
    export(cfg(trained_delta, out, "attention.cache=4", "attention.cache_select=self_recall"))
    config = json.loads((out / "config.json").read_text())["hybrid"]
    assert (config["la_kind"], config["la_combine"], config["la_conv"]) == ("gated_delta", "mix", 4)
    assert (config["cache"], config["cache_select"]) == (4, "self_recall")
    _, got = load_alone(out, tmp_path)
    ref = hs.load_converted(trained_delta / "stage2_best", dtype=torch.float32)
    hs.models.convert.set_cache(ref, 4, "self_recall")
    assert_matches(got, ref)
    assert torch.equal(got["compiled"], got["gen"])
    hs.models.convert.set_cache(ref, 0)
    with torch.no_grad():  # (the cache is at work in these 40 tokens past a window of 8)
        assert not torch.allclose(got["logits"], ref(ids()).logits, atol=1e-3)


@pytest.fixture(scope="module")
def trained_granite(smollm2, trained, tmp_path_factory):
    """A stage-2-like Granite model (the architecture added as one record: attention/hf/architectures.py), its own
    multipliers and scores' scale away from Llama's (tests/conftest.py ARCHS)."""
    root = tmp_path_factory.mktemp("export_granite")
    model = tiny_model("granite", vocab_size=49152, pad_token_id=2, eos_token_id=2, bos_token_id=1)
    model.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(smollm2.model).save_pretrained(root / "base")
    save_stage2_like(model, root / "stage2_best", root / "base", hybrid_sinks=True, la_decay=True)
    shutil.copy(trained / "text.txt", root / "text.txt")
    return root


def test_a_granite_export_runs_its_remote_code_alone_and_matches_the_toolkit(trained_granite, tmp_path):
    """An architecture added as one record converts, trains (a LoRA adapter), exports and loads alone: the export's
    classes are made from the record, and logits, padding, la_only and generation equal the toolkit's model."""
    out = tmp_path / "export"
    export(cfg(trained_granite, out))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "hybrid_scale_granite" and config["attention_multiplier"] == 0.2
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_hybrid_scale.HybridScaleGraniteForCausalLM"
    info, got = load_alone(out, tmp_path)
    assert info["class"] == "HybridScaleGraniteForCausalLM" and info["imported"] == []
    assert_matches(got, hs.load_converted(trained_granite / "stage2_best", dtype=torch.float32))


BUDGETS_ALONE = r"""
import sys
for name in ("hybrid_scale", "peft", "deepspeed"):
    sys.modules[name] = None
import torch
from transformers import AutoModelForCausalLM
path, out, ids = sys.argv[1], sys.argv[2], torch.load(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
layers = {m.layer_idx: m.cache_budget.tolist() for m in model.modules() if hasattr(m, "cache_budget")}
with torch.no_grad():
    logits = model(ids).logits
gen = model.generate(ids[:1], max_new_tokens=12, do_sample=False)
torch.save({"logits": logits, "gen": gen, "layers": layers}, out)
"""


def test_an_export_with_retrieval_budgets_applies_them_alone_as_the_toolkit(trained, tmp_path, monkeypatch):
    """attention.cache_heads=retrieval: the export calibrates each layer's budgets (summing to cache x Hkv) and writes
    them into config.json's hybrid.cache_budgets; its remote code, alone, applies them at load time and gives the
    toolkit's logits and greedy tokens with the same budgets (planted uneven budgets, so that ignoring them shows)."""
    from hybrid_scale.models import cache_heads

    real, calibrated = cache_heads.retrieval_budgets, []
    planted = {0: torch.tensor([1, 7]), 1: torch.tensor([6, 2])}

    def calibrate(*args, **kwargs):
        calibrated.append(real(*args, **kwargs))
        return planted

    monkeypatch.setattr(export_stage, "retrieval_budgets", calibrate)  # (the name the export calls)
    out = tmp_path / "export"
    export(cfg(trained, out, "attention.cache=4", "attention.cache_heads=retrieval"))
    (got_budgets,) = calibrated
    assert set(got_budgets) == {0, 1} and all(int(b.sum()) == 8 and int(b.min()) >= 1 for b in got_budgets.values())
    hybrid = json.loads((out / "config.json").read_text())["hybrid"]
    assert hybrid["cache_budgets"] == {"0": [1, 7], "1": [6, 2]} and hybrid["cache"] == 4
    torch.save(ids(), tmp_path / "ids.pt")
    (tmp_path / "load.py").write_text(BUDGETS_ALONE)
    proc = subprocess.run(
        [sys.executable, "-I", "load.py", str(out), str(tmp_path / "out.pt"), str(tmp_path / "ids.pt")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    assert got["layers"] == {0: [1, 7], 1: [6, 2]}
    ref = hs.load_converted(trained / "stage2_best", dtype=torch.float32)
    set_cache(ref, 4, "attention", planted)
    x = ids()
    with torch.no_grad():
        assert torch.allclose(got["logits"], ref(x).logits, atol=1e-5)
    assert torch.equal(got["gen"], ref.generate(x[:1], max_new_tokens=12, do_sample=False))
    set_cache(ref, 4, "attention")
    with torch.no_grad():  # (the budgets are at work: the uniform cache gives other logits)
        assert not torch.allclose(got["logits"], ref(x).logits, atol=1e-4)
