"""Trust at the process edge, shared by instances and the router: signing internal calls and
their answers (`auth`), deciding which signed calls are this process's (`call_guard`), deadlines
and parser refusals on every HTTP connection (`http_guard`), and TLS contexts (`tls`). No torch.
"""
