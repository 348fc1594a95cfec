"""The CLI's commands, one module per group; `cli.py` names them and their one-line help."""
