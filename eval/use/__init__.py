"""Use what you trained: ``ddcl-vq export`` (a run -> a shareable model folder that
``VQVAE.from_pretrained`` loads), ``ddcl-vq tokenize`` (a dataset split -> the hard code indices a
prior trains on, as .npy or safetensors) and ``ddcl-vq decode`` (indices -> a PNG grid).

Modules: ``files`` (the token file format: write, read, index dtype by K), ``models`` (load a run
directory or an exported folder), ``export``, ``tokenize_split``, ``decode`` (one command each).
"""
