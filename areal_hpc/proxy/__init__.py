"""The login-node proxy: an OpenAI-compatible gateway in front of the rollout servers that turns external
agents' traffic into per-tenant trajectory records.

    areal-hpc proxy --config configs/my-run.yaml proxy.keys_file=$HOME/proxy-keys.yaml

Runs without a GPU and imports no torch (tested): aiohttp for HTTP, ``tokenizers`` + jinja2 for the
chat template, h5py for the shards. See docs/tutorials/proxy.md.
"""
