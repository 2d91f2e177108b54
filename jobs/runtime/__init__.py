"""What the long-running commands (``runworker``, ``runscheduler``) share: signals, the private
HTTP listener, the process's row in ``jobs_process``.
"""
