"""One user-visible action per module (prune, restore, verify, status, index repair).

Each orchestrates the layers below for one command: the CLI, the daemon and the Python API call the
same action with typed arguments and get typed results or real exceptions back.
"""
