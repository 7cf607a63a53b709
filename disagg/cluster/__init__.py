"""`disagg up` and `disagg scale`: a cluster of router + instances, started, watched, stopped.

The local launcher runs each process as a child of this one; the Ray backend runs each as the
child of a Ray actor. Both plan the same children from one ClusterConfig. Serving and routing
live in the children: nothing here imports torch, except to convert a short model name once.
"""
