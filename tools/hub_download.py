#!/usr/bin/env python3
"""Download a model or dataset from the Hugging Face Hub into its cache, for eo-ddp.

    hub_download.py model|dataset REPO_ID REVISION config|all

eo-ddp runs this when a config names a model (base_model: org/name) or dataset (path: org/name)
that is neither a local path nor in the Hugging Face cache; it is not meant to be called by hand.
huggingface_hub's snapshot_download fetches only the files eo-ddp reads (a model: config.json,
and for `all` its safetensors, their index, tokenizer and generation config; a dataset: its data
files), into the cache huggingface_hub uses (HF_HUB_CACHE / HF_HOME), with its progress bars on
stderr. The snapshot folder is printed on stdout. Exit 2 with `error: ...` for a repository or
revision the Hub does not have (or that needs a login).
"""
import os
import sys

# tools/ is not a package; keep our own folder off the import path (it must not shadow stdlib).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
               "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"]
DATASET_FILES = ["*.jsonl", "*.json", "*.parquet", "**/*.jsonl", "**/*.json", "**/*.parquet"]


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("model", "dataset") or sys.argv[4] not in ("config", "all"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    kind, repo_id, revision, what = sys.argv[1:]
    import huggingface_hub
    from huggingface_hub import errors
    from tqdm.auto import tqdm

    class Progress(tqdm):
        """A redraw every few seconds at most: eo-ddp logs each as a line."""
        def __init__(self, *args, **kwargs):
            kwargs["mininterval"] = max(kwargs.get("mininterval") or 0, 5.0)
            super().__init__(*args, **kwargs)

    patterns = DATASET_FILES if kind == "dataset" else (["config.json"] if what == "config" else MODEL_FILES)
    try:
        path = huggingface_hub.snapshot_download(repo_id=repo_id, repo_type=kind, revision=revision or None,
                                                 allow_patterns=patterns, tqdm_class=Progress)
    except errors.GatedRepoError:
        print(f"error: the Hub's {kind} {repo_id} is gated: accept its terms on the Hub and log in with "
              "`hf auth login`", file=sys.stderr)
        sys.exit(2)
    except errors.RepositoryNotFoundError:
        print(f"error: the Hub has no {kind} {repo_id} (or it is private or gated: log in with `hf auth login`)",
              file=sys.stderr)
        sys.exit(2)
    except errors.RevisionNotFoundError:
        print(f"error: the Hub's {kind} {repo_id} has no revision {revision!r}", file=sys.stderr)
        sys.exit(2)
    print(path)


if __name__ == "__main__":
    main()
