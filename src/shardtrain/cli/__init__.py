"""The `shardtrain` command line: `config`, `launch`, `merge`, `env`.

shardtrain --help
python -m shardtrain.cli.main launch --num_processes 2 train.py
"""
