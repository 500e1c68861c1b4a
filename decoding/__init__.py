"""Speculative decoding engine: drafters, verification, the step loop and the async facade."""

import os

# Nothing here downloads from a model hub: a source that is no pinned alias, tiny model, local directory
# or .gguf file is looked up in the local Hugging Face cache only. Set before transformers or
# huggingface_hub is first imported (they read it once, then); an operator who does want hub downloads
# sets HF_HUB_OFFLINE=0 themselves.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
