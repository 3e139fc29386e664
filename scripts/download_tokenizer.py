"""Download a model family's tokenizer file from its HuggingFace repository to where the recipes
look for it.

    HF_TOKEN=hf_... python scripts/download_tokenizer.py llama3   # -> ./assets/tokenizer/llama3/
    python scripts/download_tokenizer.py mixtral --out /data/tok/mixtral.model
    python scripts/download_tokenizer.py qwen3   # tokenizer.json; Qwen's repositories are open

Llama's and Mixtral's repositories are gated: accept the model's licence on its HuggingFace page
first, with the account the token belongs to (or log in with `hf auth login`). Exit 0: written;
1: the download failed (no network, no access); 2: bad arguments. Each failure is one line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan_xla.datasets.tokenizer.hub import SOURCES  # noqa: E402
from torchtitan_xla.errors import first_line  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("model", choices=sorted(SOURCES), help="model family ([model] name)")
    parser.add_argument("--out", help="file to write (default: the recipes' tokenizer_path)")
    parser.add_argument("--token", help="HuggingFace token (default: HF_TOKEN or the saved login)")
    parser.error = lambda message: sys.exit(print(f"error: {message}", file=sys.stderr) or 2)  # one line
    args = parser.parse_args(argv)
    source = SOURCES[args.model]
    out = Path(args.out or source.default_path)

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        cached = hf_hub_download(source.repo, source.filename, token=args.token)
    except GatedRepoError:  # before RepositoryNotFoundError: it is a subclass of it
        print(f"error: {source.repo} is gated and this token has no access: accept the licence at "
              f"{source.url} with your account, then set HF_TOKEN (or pass --token)", file=sys.stderr)
        return 1
    except RepositoryNotFoundError:
        print(f"error: {source.repo} not found, or private to this token: log in (HF_TOKEN or "
              f"--token) with an account that accepted the licence at {source.url}", file=sys.stderr)
        return 1
    except LocalEntryNotFoundError:  # offline (HF_HUB_OFFLINE) or the Hub unreachable
        why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") else "no network?"
        print(f"error: cannot download {source.filename} from {source.repo}: the HuggingFace Hub is "
              f"not reachable ({why}); download it on a machine with network and copy it to {out}",
              file=sys.stderr)
        return 1
    except OSError as e:  # an HTTP error the Hub library did not classify, or the cache unwritable
        print(f"error: cannot download {source.filename} from {source.repo}: {first_line(e)}",
              file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, out)
    print(f"wrote {out} ({out.stat().st_size:,} bytes) from {source.repo}/{source.filename}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
