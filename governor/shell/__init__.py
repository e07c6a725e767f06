"""The shell: what reads the configuration, builds every layer and runs them.

`cli.py` (the `governor` command and its subcommands), `config.py` (the flags and their checks),
`endpoints.py` (an endpoint's `ADDRESS[,key=value...]`), `config_file.py` (the TOML file and SIGHUP
reloads), `server.py` (builds the layers, binds the ports, runs until stopped), `spawned.py` and
`supervisor.py` (the worker processes it starts and restarts).

May import: anything of the governor. Nothing imports the shell.
"""
