"""Tasks: what the agents are asked (one prompt formatter per agent) and how joint responses are scored.

:mod:`pbrl.tasks.base` defines :class:`~pbrl.tasks.base.Task`; :mod:`pbrl.tasks.registry` maps names to the shipped
tasks (``toy``, ``humaneval_docs``, ``humaneval_coop``).
"""
