"""GPU health on the VM: kernel records (kmsg), the Xid table (xid), fault episodes (episode).

``xid`` and ``episode`` are pure decision cores; ``kmsg`` holds the record parser (pure) and the
reader of ``/dev/kmsg`` (the edge). No module here imports a GPU library.
"""
