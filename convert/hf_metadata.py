"""The general.* keys of a converted model, by the rules of llama.cpp's converter (gguf-py's
Metadata, b11434): what a Hugging Face folder tells of the model besides its weights.

Each field takes the first source that gives it:
1. the model card (README.md's YAML front matter): its name, author, license, tags ... fields,
   base_model and datasets entries, language and pipeline_tag;
2. config.json's _name_or_path where it is a Hub id ("org/name", not a path of the machine);
3. the folder's own name.
A Hub id or folder name ("SmolLM2-135M-Instruct") gives the model's name title-cased ("SmolLM2 135M
Instruct") and its parts: basename (SmolLM2), size label (135M), finetune (Instruct), version (v0.1).
Where no name gives a size label, it comes from the parameter count ("135M", "8x7.2B" for a
mixture: its experts and the size of one). generation_config.json gives the sampling keys.
Empty strings and lists are left out, as llama.cpp's writer leaves them out.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFValueType

STRING, ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY

# generation_config.json's fields (the first of several given) -> general.sampling.KEY and its type
_SAMPLING = (("sequence", ("sequence",), STRING), ("top_k", ("top_k",), GGUFValueType.INT32),
             ("top_p", ("top_p",), GGUFValueType.FLOAT32), ("min_p", ("min_p",), GGUFValueType.FLOAT32),
             ("xtc_probability", ("xtc_probability",), GGUFValueType.FLOAT32),
             ("xtc_threshold", ("xtc_threshold",), GGUFValueType.FLOAT32),
             ("temp", ("temperature",), GGUFValueType.FLOAT32),
             ("penalty_last_n", ("penalty_last_n",), GGUFValueType.INT32),
             ("penalty_repeat", ("penalty_repeat", "repetition_penalty"), GGUFValueType.FLOAT32),
             ("mirostat", ("mirostat",), GGUFValueType.INT32),
             ("mirostat_tau", ("mirostat_tau",), GGUFValueType.FLOAT32),
             ("mirostat_eta", ("mirostat_eta",), GGUFValueType.FLOAT32))

# field -> the model card's keys for it, the first given winning
_CARD_FIELDS = {"name": ("name", "model_name"), "author": ("author", "model_author", "model_creator"),
                "version": ("version", "model_version"), "organization": ("organization", "model_organization"),
                "description": ("description", "model_description"), "finetune": ("finetune", "model_finetune"),
                "basename": ("basename", "model_basename", "model_type"),
                "size_label": ("size_label", "model_size_label"), "source.url": ("url", "model_url"),
                "source.doi": ("doi", "model_doi"), "source.uuid": ("uuid", "model_uuid"),
                "source.repo_url": ("repo_url", "model_repo_url"), "license": ("license",),
                "license.name": ("license_name",), "license.link": ("license_link",)}
# the single-valued keys in the order llama.cpp writes them (general.KEY)
_WRITTEN = ("name", "author", "version", "organization", "finetune", "basename", "description", "size_label",
            "license", "license.name", "license.link", "source.url", "source.doi", "source.uuid", "source.repo_url")
# the keys of one base model or data set entry (general.base_model.N.KEY), in order
_ENTRY_KEYS = ("name", "author", "version", "organization", "description", "url", "doi", "uuid", "repo_url")
# the card's keys for the lists of entries (the first present), and the GGUF key prefix
_ENTRY_LISTS = ((("base_model", "base_models", "base_model_sources"), "base_model"),
                (("datasets", "dataset", "dataset_sources"), "dataset"))


def general_metadata(folder: Path, tensors) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """The general keys after general.type, typed, in llama.cpp's order, for a model converted from
    folder into tensors (each with .name and .shape in GGML order)."""
    card = read_model_card(folder)
    total, shared, experts, n_expert = parameter_counts(tensors)
    fields = {}
    for field, keys in _CARD_FIELDS.items():
        value = next((v for v in (_card_text(card.get(k), field == "license") for k in keys) if v is not None), None)
        if value is not None:
            fields[field] = value
    config = _json_object(folder / "config.json")
    hub_id = config.get("_name_or_path")
    for model_id in ([hub_id] if isinstance(hub_id, str) and hub_id.count("/") <= 1 else []) + [folder.name]:
        parts = model_id_parts(model_id, total)
        parts["name"] = title(parts["name"])
        if parts["organization"] is not None:
            parts["organization"] = title(parts["organization"])
        for field, value in parts.items():
            if value is not None:
                fields.setdefault(field, value)
    if "size_label" not in fields and total > 0:
        fields["size_label"] = size_label(total, shared, experts, n_expert)

    md = []
    generation = _json_object(folder / "generation_config.json")
    for key, names, vtype in _SAMPLING:
        value = next((generation[n] for n in names if generation.get(n) is not None), None)
        if value is not None:
            md += _typed(f"general.sampling.{key}", value, vtype)
    for field in _WRITTEN:
        md += _typed(f"general.{field}", fields.get(field), STRING)
    for card_keys, prefix in _ENTRY_LISTS:
        if any(k in card for k in card_keys):
            entries = _card_entries(next(card[k] for k in card_keys if k in card), total)
            md.append((f"general.{prefix}.count", len(entries), GGUFValueType.UINT32, None))
            for i, entry in enumerate(entries):
                for key in _ENTRY_KEYS:
                    md += _typed(f"general.{prefix}.{i}.{key}", entry.get(key), STRING)
    for key, card_keys in (("tags", ("tags", "pipeline_tag")), ("languages", ("languages", "language"))):
        values = [str(v) for k in card_keys for v in _as_list(card.get(k)) if v is not None]
        if values:
            md.append((f"general.{key}", values, ARRAY, STRING))
    return md


def read_model_card(folder: Path) -> dict:
    """README.md's YAML front matter (between its first line, ---, and the next ---), {} where
    there is none. A card that is not valid YAML is left unread, with a warning."""
    import yaml
    path = folder / "README.md"
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0] != "---":
        return {}
    front = []
    for line in lines[1:]:
        if line == "---":
            break
        front.append(line)
    # (a language list's "- no" is Norwegian, not YAML's false; tabs read as two spaces)
    text = ("\n".join(front) + "\n").replace("- no\n", '- "no"\n').replace("\t", "  ")
    try:
        card = yaml.safe_load(text)
    except yaml.YAMLError as e:
        print(f"warning: {path}: the model card's metadata is not valid YAML ({e.__class__.__name__}); "
              f"converting without it", file=sys.stderr)
        return {}
    return card if isinstance(card, dict) else {}


_VERSION = re.compile(r"(v|iter)?\d+(\.\d+)*", re.IGNORECASE)
_QUANT_TYPE = re.compile(r"i?q\d(_\w)*|b?fp?(16|32)", re.IGNORECASE)
_SIZE = re.compile(r"(([A]|\d+[x])?\d+([._]\d+)?[KMBT]\d?|small|mini|medium|large|x?xl)", re.IGNORECASE)
_FINETUNE = re.compile(r"chat|instruct|vision|lora", re.IGNORECASE)
_SUFFIXES = " KMBT"


def model_id_parts(model_id: str, total_params: int = 0) -> dict:
    """A Hub id ("org/Name-7B-Instruct-v0.2") or folder name read for the model's name (as typed),
    organization, basename, size label, finetune and version (None where it gives none).

    The name's dash-separated words are each read as one of: a version (v2, 3.1, iter5), a quant
    type (Q4_K_M, bf16: uppercased), and past the first word a size (7B, 8x7B, 135m -> 135M, 7b1 ->
    7.1B, small ... xl; a number far from the model's parameter count is a context length, 8k, and
    goes with the finetune), or a finetune word (chat, instruct, vision, lora). Word sizes give way
    to numeric ones. The leading words that are plain words or versions are the basename (less
    trailing versions); the plain words after it are the finetune. A name with no size, finetune or
    version has no basename either."""
    empty = dict(name=None, organization=None, basename=None, finetune=None, version=None, size_label=None)
    if " " in model_id:  # (a name as a person writes it, not an id)
        return {**empty, "name": model_id}
    org, name = model_id.split("/", 1) if "/" in model_id else (None, model_id)
    if org is not None and org.startswith("."):  # ("./folder", "../folder")
        org = None
    words = [w for w in name.split("-") if w]
    kinds: list[set] = [set() for _ in words]
    for i, word in enumerate(words):
        if _VERSION.fullmatch(word):
            kinds[i].add("version")
        elif _QUANT_TYPE.fullmatch(word):
            kinds[i].add("type")
            words[i] = word.upper()
        elif i > 0 and _SIZE.fullmatch(word):
            words[i] = _size_word(word, total_params, kinds[i])
        elif i > 0 and _FINETUNE.fullmatch(word):
            kinds[i].add("finetune")
    if any(ch.isdecimal() for w, k in zip(words, kinds) if "size_label" in k for ch in w):
        for w, k in zip(words, kinds):
            if "size_label" in k and w.isalpha():
                k.discard("size_label")
    leading = True
    for w, k in zip(words, kinds):
        if leading and ((not k and w[0].isalpha()) or "version" in k):
            k.add("basename")
        else:
            leading = False
            if not k:
                k.add("finetune")
    for k in reversed(kinds):  # (a version that ends the basename is the version)
        if "basename" not in k or len(k) == 1:
            break
        k.discard("basename")

    def joined(kind, unique=False):
        chosen = [w for w, k in zip(words, kinds) if kind in k and (kind != "version" or "basename" not in k)]
        return "-".join(dict.fromkeys(chosen) if unique else chosen) or None
    parts = dict(name=name, organization=org, basename=joined("basename"), finetune=joined("finetune"),
                 version=joined("version"), size_label=joined("size_label", unique=True))
    if parts["size_label"] is None and parts["finetune"] is None and parts["version"] is None:
        parts["basename"] = None  # (too little to tell the basename apart)
    return parts


def _size_word(word: str, total_params: int, kind: set) -> str:
    """A size word normalized (7b -> 7B, 7_5b -> 7.5B, bloom's 7b1 -> 7.1B); kind gets size_label,
    or finetune where the number is far from the parameter count (then a context length, 8k)."""
    word = word.replace("_", ".")
    if word[-1].isdecimal():
        word = f"{word[:-2]}.{word[-1]}{word[-2]}"
    if len(word) > 1 and word[-2].isdecimal() and word[-1] in "kmbt":
        word = word[:-1] + word[-1].upper()
    if total_params > 0:
        try:
            labelled = float(word[:-1]) * pow(1000, _SUFFIXES.find(word[-1]))
        except ValueError:  # (8x7B, small: no number to compare)
            labelled = None
        if labelled is not None and abs(labelled - total_params) > 7 * total_params // 8:
            kind.add("finetune")
            word = word[:-1] + word[-1].lower()
    if not kind:
        kind.add("size_label")
    return word


def title(text: str) -> str:
    """A name for people: dashes as spaces, all-lowercase words title-cased but versions (v2.1)
    and words that start with a digit (7b); other words as typed (SmolLM2, GPT)."""
    return " ".join(w.title() if w.islower() and not re.fullmatch(r"v\d+(\.\d+)*|\d.*", w) else w
                    for w in text.strip().replace("-", " ").split())


def parameter_counts(tensors) -> tuple[int, int, int, int]:
    """(all parameters, those outside experts, one expert's share of each expert tensor summed,
    experts a layer) over tensors with .name and .shape (GGML order): a stacked expert tensor
    (name with _exps., 3-D) counts its experts on its last axis, a bias's on the one before."""
    total = shared = per_expert = counted = n_expert_tensors = 0
    for t in tensors:
        size = int(np.prod(t.shape, dtype=np.int64))
        total += size
        if "_exps." in t.name and len(t.shape) >= 3:
            n = t.shape[1] if ".bias" in t.name else t.shape[2]
            per_expert += size // n
            counted += n
            n_expert_tensors += 1
        else:
            shared += size
    return total, shared, per_expert, counted // n_expert_tensors if n_expert_tensors else 0


def size_label(total: int, shared: int, per_expert: int, n_expert: int) -> str:
    """The parameter count rounded to two significant digits or more (135M, 1.7B, 70B, 8x7.2B)."""
    if n_expert > 0:
        return f"{n_expert}x{_rounded_count(abs(shared) + abs(per_expert))}"
    return _rounded_count(abs(total))


def _rounded_count(n: int) -> str:
    scale, suffix = next((s, x) for limit, s, x in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M"),
                                                    (-1, 1e-3, "K")) if n > limit)
    scaled = n * scale
    decimals = max(2 - len(str(round(scaled)).lstrip("0")), 0)
    return f"{scaled:.{decimals}f}{suffix}"


def _card_entries(value, total_params: int) -> list[dict]:
    """A card's base_model or datasets value (an id, a URL, an entry of fields, or a list of them)
    as entries of the keys _ENTRY_KEYS: an id gives its title-cased name, organization, version and
    Hub URL; a URL itself and, on the Hub, what its id gives but the URL."""
    entries = []
    for item in _as_list(value):
        entry = {}
        if isinstance(item, dict):
            entry = {k: _card_text(v) for k, v in item.items()}
        elif isinstance(item, str):
            hub_id = item
            if item.startswith(("http://", "https://", "ssh://")):
                entry["repo_url"] = item
                m = re.match(r"https?://huggingface\.co/([^/]+/[^/]+)$", item) if "huggingface.co" in item else None
                hub_id = m[1] if m else None
            if hub_id is not None:
                parts = model_id_parts(hub_id, total_params)
                entry["name"] = title(parts["name"])
                if parts["organization"] is not None:
                    entry["organization"] = title(parts["organization"])
                if parts["version"] is not None:
                    entry["version"] = parts["version"]
                if hub_id == item and parts["organization"] is not None:
                    entry["repo_url"] = f"https://huggingface.co/{parts['organization']}/{parts['name']}"
        entries.append(entry)
    return entries


def _as_list(value) -> list:
    return value if isinstance(value, list) else [value] if isinstance(value, str) else []


def _card_text(value, joined: bool = False) -> str | None:
    """A card's field as text: numbers and dates as YAML wrote them in words (version: 2), a list
    (a license's) joined by commas where joined; None where it gives none."""
    if joined and isinstance(value, list):
        return ",".join(str(v) for v in value)
    if value is None or isinstance(value, (list, dict)):
        return None
    return value if isinstance(value, str) else str(value)


def _typed(key: str, value, vtype: GGUFValueType) -> list:
    """[(key, value, type, None)], or [] for a value llama.cpp's writer leaves out (none, an empty
    string) or one that is no number of its type."""
    if value is None or value == "":
        return []
    try:
        value = {STRING: str, GGUFValueType.INT32: int, GGUFValueType.FLOAT32: float}[vtype](value)
    except (TypeError, ValueError):
        return []
    return [(key, value, vtype, None)]


def _json_object(path: Path) -> dict:
    """A JSON file's object, {} where the file is missing, unreadable or holds another value."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
