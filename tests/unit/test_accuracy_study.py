"""benchmarks/accuracy_study.py's cluster path at toy size: runs done elsewhere (fake
metrics files and a console log, laid out as sample_scripts/accuracy/study.sbatch lays them
out) -> the summary's numbers, the report and the two pictures. No training."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

EVALS = (50, 100)
TOKENS_PER_IT = 16 * 128


def _metrics(folder: Path, finals: dict[int, float]) -> None:
    """A metrics.jsonl nested as an accuracy script writes it, validation loss ``finals``."""
    path = folder / "accuracy" / "125M" / "x" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    lines = []
    for it in (25, 50, 75, 100):
        lines.append({"iteration": it, "lm_loss": 6.0, "consumed_samples": 16 * it,
                      "consumed_tokens": TOKENS_PER_IT * it})
        if it in finals:
            lines.append({"iteration": it, "val_lm_loss": finals[it], "val_lm_ppl": 1.0})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _study(root: Path) -> Path:
    runs = {
        ("baseline", "ref"): 5.00, ("baseline", "seed1235"): 5.10,
        ("baseline", "seed1236"): 4.90,
        ("qWD", "rs1"): 5.01, ("qWD", "rs2"): 5.03,
        ("qW", "rs1"): 5.30, ("qW", "rs2"): 5.20, ("qW", "rs3"): 5.40,
    }
    for (method, label), final in runs.items():
        _metrics(root / method / label, {50: final + 1.0, 100: final})
    return root


def test_summary_numbers_from_metrics_files(tmp_path):
    from benchmarks import accuracy_summary as s

    summary = s.summarize(s.read_study(_study(tmp_path)))
    assert summary["final_iteration"] == 100
    qw = summary["methods"]["qW"]
    assert qw["final"]["n"] == 3 and math.isclose(qw["final"]["mean"], 5.30)
    assert math.isclose(qw["final"]["std"], 0.1)  # sample std of 5.2, 5.3, 5.4
    assert math.isclose(qw["diff"]["value"], 0.30)
    assert math.isclose(qw["diff"]["stderr"], 0.1 / math.sqrt(3))  # the ref run has no spread
    assert math.isclose(qw["diff"]["pct"], 6.0)
    qwd = summary["methods"]["qWD"]
    assert math.isclose(qwd["diff"]["value"], 0.02) and qwd["runs"] == {"rs1": 5.01, "rs2": 5.03}
    base = summary["methods"]["baseline"]
    assert base["final"]["n"] == 1 and base["diff"]["value"] == 0.0  # seed runs left out
    band = summary["seed_band"]
    assert band["runs"] == {"ref": 5.0, "seed1235": 5.1, "seed1236": 4.9}
    assert math.isclose(band["std"], 0.1) and math.isclose(band["spread_pct"], 4.0)
    # the curves: mean, min and max over the runs at each evaluation, against tokens
    assert [(p["iteration"], p["tokens"]) for p in qw["curve"]] == [
        (50, 50 * TOKENS_PER_IT), (100, 100 * TOKENS_PER_IT)]
    assert math.isclose(qw["curve"][0]["min"], 6.2) and math.isclose(qw["curve"][0]["max"], 6.4)


def test_from_runs_writes_the_report_and_pictures(tmp_path, capsys):
    from benchmarks import accuracy_study

    root = _study(tmp_path / "study")
    # a run of another trainer: only its console log, Megatron-LM's validation lines
    log = root / "TLq" / "rs1" / "slurm-7_3.out"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f" validation loss at iteration {it} | lm loss value: {v:.6E} | "
                           "lm loss PPL: 1.0E+02 |\n" for it, v in ((50, 6.5), (100, 5.5))))
    assert accuracy_study.main(["--from-runs", str(root)]) == 1  # a log records no tokens
    assert "--tokens-per-iteration" in capsys.readouterr().err
    assert accuracy_study.main(["--from-runs", str(root),
                                "--tokens-per-iteration", str(TOKENS_PER_IT)]) == 0
    record = json.loads((root / "accuracy_study.json").read_text())
    assert record["command"] == ("python -m benchmarks.accuracy_study --from-runs "
                                 f"{root} --tokens-per-iteration {TOKENS_PER_IT}")
    tlq = record["summary"]["methods"]["TLq"]
    assert math.isclose(tlq["diff"]["pct"], 10.0) and tlq["curve"][1]["tokens"] == 100 * 2048
    md = (root / "accuracy_study.md").read_text()
    assert ("| qW | 3 | 5.3000 | 0.1000 | 5.2000 | 5.4000 | +0.3000 +- 0.0577 | "
            "+6.00 +- 1.15 |") in md
    for name in ("accuracy_study_loss.png", "accuracy_study_diff.png"):
        assert (root / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("change,message", [
    ("rename", "a run folder is named ref, rs<R> .rounding seed., seed<S> .--seed., init<S> "
     ".--seed, the study's --train-data-seed. or order<S> .--train-data-seed."),
    ("short", r"the runs end their evaluations at different iterations \[50, 100\]"),
    ("nobase", "no baseline/ runs: the differences need the baseline"),
])
def test_a_study_that_cannot_be_summarized_is_named(tmp_path, change, message):
    from benchmarks import accuracy_summary as s

    root = _study(tmp_path)
    if change == "rename":
        (root / "qW" / "rs3").rename(root / "qW" / "third")
    elif change == "short":
        _metrics(root / "qWD" / "rs3", {50: 5.0})
    else:
        shutil.rmtree(root / "baseline")
    with pytest.raises(s.StudyError, match=message):
        s.summarize(s.read_study(root))


def test_the_local_plan_and_commands(tmp_path):
    from benchmarks import accuracy_study as a

    runs = a.plan(["baseline", "qWD-rounded"], [1, 2], [7], seed=1234, init_seeds=[8],
                  order_seeds=[9])
    assert runs == [("baseline", "ref", []), ("baseline", "seed7", ["--seed", "7"]),
                    ("baseline", "init8", ["--seed", "8", "--train-data-seed", "1234"]),
                    ("baseline", "order9", ["--train-data-seed", "9"]),
                    ("qWD-rounded", "rs1", ["--rounding-seed", "1"]),
                    ("qWD-rounded", "rs2", ["--rounding-seed", "2"])]
    flags = a.model_flags(1000, 100, 20, 1234)
    # every run evaluates on the same held-out samples, whatever its --seed
    assert flags[flags.index("--eval-data-seed") + 1] == str(a.EVAL_DATA_SEED)
    assert a.METHODS["qWD-rounded"] == ["--quantized-weights", "--weight-difference-target",
                                        "rounded-main"]
    sdp4bit = a.METHODS["SDP4Bit"]
    assert a.METHODS["SDP4Bit-EF"] == sdp4bit + ["--gradient-error-feedback"]
    assert a.METHODS["SDP4Bit-2bit"] == sdp4bit + ["--gradient-quantization-bits-inter", "2"]
    assert a.METHODS["SDP4Bit-2bit-EF"] == a.METHODS["SDP4Bit-2bit"] + [
        "--gradient-error-feedback"]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"iteration": 100, "val_lm_loss": 5.0}) + "\n")
    assert a.finished(metrics, 100) and not a.finished(metrics, 200)


def test_the_moe_study_writes_its_own_files(tmp_path):
    from benchmarks import accuracy_study as a

    root = _study(tmp_path / "study")
    assert a.main(["--model", "moe", "--from-runs", str(root)]) == 0
    names = sorted(p.name for p in root.iterdir() if p.is_file())
    assert names == ["accuracy_study_moe.json", "accuracy_study_moe.md",
                     "accuracy_study_moe_diff.png", "accuracy_study_moe_loss.png"]
    md = (root / "accuracy_study_moe.md").read_text()
    assert md.startswith("# Accuracy study (mixture of experts, `--model moe`)")
    assert "`--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size 2" in md
    assert a.MODELS["dense"] == ([], "accuracy_study")


def _numbered_corpus(prefix: Path, docs: int, length: int) -> str:
    """``docs`` documents of ``length`` tokens, every token of document d equal to d + 1:
    a sample's tokens name the documents it was cut from."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=numpy.uint16)
    for d in range(docs):
        builder.add_document(torch.full((length,), d + 1, dtype=torch.int64), [length])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def test_the_held_out_set_is_one_for_every_run_and_never_trained_on(tmp_path):
    """The study's own flags (split, --eval-data-seed, sizes at 50 iterations) on a corpus
    whose tokens name their documents, every dataset built by the trainer's builder into one
    shared index cache: the validation samples are the same whatever --seed or
    --train-data-seed, none of their documents is in any training sample, the training order
    follows --train-data-seed (else --seed), and a cache filled by other seeds gives the
    samples a fresh cache gives."""
    from benchmarks import accuracy_study as a
    from megatron.sdp4bit.training.cli.arguments import parse_args
    from megatron.sdp4bit.training.data import build_datasets
    from megatron.sdp4bit.training.tokenizers import build_tokenizer

    docs = 200
    corpus = _numbered_corpus(tmp_path / "numbered", docs, 100)

    def build(cache: Path, *extra: str) -> list[list[frozenset]]:
        args = parse_args(a.model_flags(50, 25, 10, 1234) + [
            "--data-path", corpus, "--data-cache-path", str(cache), "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "512", *extra], world_size=a.NPROC)
        assert args.split == "95,5,0" and args.eval_data_seed == a.EVAL_DATA_SEED
        return [[frozenset((d["tokens"].tolist() + d["labels"].tolist())) for d in
                 (ds[i] for i in range(len(ds)))] if ds is not None else []
                for ds in build_datasets(args, build_tokenizer(args))]

    cache = tmp_path / "index"
    runs = {"ref": build(cache), "seed1235": build(cache, "--seed", "1235"),
            "init1235": build(cache, "--seed", "1235", "--train-data-seed", "1234"),
            "order1235": build(cache, "--train-data-seed", "1235")}
    ref = runs["ref"]
    held_out = set().union(*ref[1])
    assert held_out == set(range(int(0.95 * docs) + 1, docs + 1))  # the last 5% of documents
    for label, (train, valid, test) in runs.items():
        assert valid == ref[1], label  # the same samples in the same order
        assert len(valid) >= (50 // 25 + 1) * 10 * 16 and test == []  # whole epochs
        assert not set().union(*train) & held_out, label  # no held-out token is trained on
    assert runs["init1235"][0] == ref[0]  # another initialization, the same order
    assert runs["order1235"][0] == runs["seed1235"][0] != ref[0]  # another order
    assert build(tmp_path / "fresh", "--train-data-seed", "1235") == runs["order1235"]


def test_a_rebuilt_corpus_drops_the_cached_sample_indices(tmp_path, monkeypatch):
    """The cached indices are named by the corpus's path, not its contents: a corpus built
    again (another text, vocabulary or version) must not meet the old corpus's indices; an
    unchanged corpus keeps them. The tokenizer is trained for real on a tiny text; the
    default corpus and the tokenization are stand-ins."""
    import subprocess
    from types import SimpleNamespace

    from benchmarks import accuracy_study as a

    text = tmp_path / "kjv.jsonl"
    text.write_text("".join(json.dumps({"text": f"and the {w} said unto them"}) + "\n"
                            for w in ("lord", "king", "people", "angel")))
    tokenized = []

    def run(cmd, **kwargs):
        if "--print-flags" in cmd:
            return SimpleNamespace(stdout=f"--data-path {tmp_path}/kjv_text_document\n")
        tokenized.append(cmd)  # tools/preprocess_data.py
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", run)
    cache = tmp_path / "study"
    stale = cache / "index" / "x-GPTDataset-train-sample_index.npy"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"old")
    flags = a.prepare_data(cache)
    assert len(tokenized) == 1 and not stale.parent.exists()
    assert flags[flags.index("--data-cache-path") + 1] == str(cache / "index")
    stale.parent.mkdir()
    stale.write_bytes(b"current")
    assert a.prepare_data(cache) == flags and len(tokenized) == 1 and stale.is_file()
    text.write_text(text.read_text() + json.dumps({"text": "a new chapter"}) + "\n")
    a.prepare_data(cache)
    assert len(tokenized) == 2 and not stale.parent.exists()


def test_the_bands_split_the_seed_band_and_earlier_rows_are_carried_over(tmp_path, capsys):
    """init<S> / order<S> baseline runs give the initialization's and the sample order's
    bands; an earlier record's rows join a study that lacks them only when the baseline's
    ref run is the record's, evaluation for evaluation."""
    from benchmarks import accuracy_study as a
    from benchmarks import accuracy_summary as s

    old = _study(tmp_path / "old")
    assert a.main(["--from-runs", str(old)]) == 0
    record = json.loads((old / "accuracy_study.json").read_text())
    new = tmp_path / "new"
    for label, final in {"ref": 5.00, "init7": 5.20, "init8": 4.80, "order7": 5.02}.items():
        _metrics(new / "baseline" / label, {50: final + 1.0, 100: final})
    for r, final in ((1, 5.10), (2, 5.14)):
        _metrics(new / "qWD-EF" / f"rs{r}", {50: final + 1.0, 100: final})
    summary = s.summarize(s.read_study(new), carry=record)
    assert list(summary["methods"]) == ["baseline", "qW", "qWD", "qWD-EF"]  # sorted, merged
    assert summary["methods"]["qW"] == {**record["summary"]["methods"]["qW"]}
    assert math.isclose(summary["methods"]["qWD-EF"]["diff"]["value"], 0.12)
    assert summary["carried"]["names"] == ["qW", "qWD", "baseline/seed1235",
                                           "baseline/seed1236"]
    assert summary["seed_band"]["runs"] == {"ref": 5.0, "seed1235": 5.1, "seed1236": 4.9}
    assert summary["init_band"]["runs"] == {"ref": 5.0, "init7": 5.2, "init8": 4.8}
    assert math.isclose(summary["init_band"]["spread_pct"], 8.0)
    assert math.isclose(summary["order_band"]["std"], math.sqrt(2) * 0.01)
    md = s.render(summary, ["# t"])
    assert ("| initialization and dropout (--seed, the same --train-data-seed) | 3 | "
            "ref 5.0000, init7 5.2000, init8 4.8000 | 5.0000 | 0.2000 | 8.00 |") in md
    assert ("the standard deviation of the final loss is 0.2000 over initializations and "
            "0.0141 over sample orders (0.1000 over both, --seed)") in md
    shutil.rmtree(new / "baseline" / "ref")
    _metrics(new / "baseline" / "ref", {50: 6.01, 100: 5.0})  # the final alone agrees
    (tmp_path / "other.json").write_text(json.dumps({"command": "python x"}))
    with pytest.raises(SystemExit):
        a.main(["--from-runs", str(new), "--carry-over", str(tmp_path / "other.json")])
    assert "not an accuracy_study.json record (no summary of methods in it)" in (
        capsys.readouterr().err)
    with pytest.raises(s.StudyError, match=r"does not reproduce the record's \(iteration, "
                       r"loss\) \(50, 6.0\) \(here \(50, 6.01\)\)"):
        s.summarize(s.read_study(new), carry=record)


def test_a_record_that_carried_rows_passes_them_on_with_their_bands_and_origin(tmp_path):
    """Carrying over from a record that itself carried rows keeps all of them: its methods
    and carried methods, the baseline's seed, init and order runs, and where each came from
    (the record's date and command, then the earlier record's)."""
    from benchmarks import accuracy_study as a
    from benchmarks import accuracy_summary as s

    old = _study(tmp_path / "old")
    assert a.main(["--from-runs", str(old)]) == 0
    record = json.loads((old / "accuracy_study.json").read_text())
    record.update(date="2026-01-01", command="python old")
    mid = tmp_path / "mid"
    for label, final in {"ref": 5.00, "init7": 5.20, "order7": 5.02}.items():
        _metrics(mid / "baseline" / label, {50: final + 1.0, 100: final})
    _metrics(mid / "qWD-EF" / "rs1", {50: 6.1, 100: 5.1})
    mid_record = {"summary": s.summarize(s.read_study(mid), carry=record),
                  "date": "2026-02-02", "command": "python mid",
                  "methods": {"baseline": [], "qWD-EF": ["--ef"]},
                  "carried_methods": {"qW": ["--qw"], "qWD": ["--qwd"]}}
    new = tmp_path / "new"
    _metrics(new / "baseline" / "ref", {50: 6.0, 100: 5.0})
    _metrics(new / "qWD-2bit" / "rs1", {50: 6.2, 100: 5.2})
    summary = s.summarize(s.read_study(new), carry=mid_record)
    assert list(summary["methods"]) == ["baseline", "qW", "qWD", "qWD-2bit", "qWD-EF"]
    assert summary["seed_band"]["runs"] == {"ref": 5.0, "seed1235": 5.1, "seed1236": 4.9}
    assert summary["init_band"]["runs"] == {"ref": 5.0, "init7": 5.2}
    assert summary["order_band"]["runs"] == {"ref": 5.0, "order7": 5.02}
    assert summary["carried"]["date"] == "2026-02-02"
    assert summary["carried"]["earlier"]["date"] == "2026-01-01"
    md = a.render({"command": "python new", "date": "2026-03-03", "summary": summary,
                   "methods": {"baseline": [], "qWD-2bit": ["--two"]},
                   "carried_methods": a.carried_methods(mid_record, ["baseline", "qWD-2bit"])})
    assert "by this study from the record of 2026-02-02 (`python mid`" in md
    assert "by the record of 2026-02-02 from the record of 2026-01-01 (`python old`" in md
    for row in ("| qW | `--qw` |", "| qWD | `--qwd` |", "| qWD-EF | `--ef` |",
                "| qWD-2bit | `--two` |"):
        assert row in md


def test_kept_runs_report_their_own_wall_time_and_load(tmp_path):
    """A study that keeps finished runs reports the time and load each run recorded when it
    trained, not the instant of the summary."""
    from benchmarks import accuracy_study as a
    from benchmarks import accuracy_summary as s

    folders = {"qW/rs1": tmp_path / "qW" / "rs1", "qW/rs2": tmp_path / "qW" / "rs2"}
    for name, load in (("qW/rs1", [2.0, 9.5]), ("qW/rs2", None)):
        folders[name].mkdir(parents=True)
        if load:
            (folders[name] / a.RUN_RECORD).write_text(json.dumps(
                {"seconds": 150.0, "load_average": load}))
    runs = a.run_records(folders)
    assert runs == {"qW/rs1": {"seconds": 150.0, "load_average": [2.0, 9.5]}}
    summary = s.summarize(s.read_study(_study(tmp_path / "study")))
    md = a.render({"command": "c", "date": "d", "runs": runs, "summary": summary,
                   "methods": {"qWD": ["--quantized-weights"]},
                   "carried_methods": {"qW": ["--weight-quantization-mode", "direct"]}})
    assert ("- the runs' wall time and load (each run's `run.json`): 2 min for 1 runs, "
            "1-minute load average 2.0 to 9.5 at their starts and ends") in md
    # the flags of the rows run here and of those carried from an earlier record
    assert "| qWD | `--quantized-weights` |\n| qW | `--weight-quantization-mode direct` |" in md
