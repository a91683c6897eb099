"""The sm90 backward: `host.py` (launch), `entry.py` (the launch entry), `kernel.py` /
`kernel_ws.py` (Gluon bodies), `parts.py` (device pieces they share), `config.py` (BwdConfig),
`dq_fragments.py`."""
