"""`disagg status`: a live view of every instance behind a router.

`probe.py` asks the router and each instance over HTTP and never raises (`answer.py`: what
came back); `snapshot.py` turns the answers into `records.py` (pure; `prom_text.py` reads
/metrics); `screen.py` draws a snapshot as text (pure); `main.py` is the command and the
terminal. Never imports torch.
"""
