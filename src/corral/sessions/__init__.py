"""The interactive side: shells on a terminal in the box, and the humans who join them.

Read in this order: :mod:`~corral.sessions.expect` (the sans-IO matcher: bytes in, a
``Match`` out), :mod:`~corral.sessions.pty` (``PtySession``, the I/O driver around it),
:mod:`~corral.sessions.batch` (scripted send/expect steps over a session),
:mod:`~corral.sessions.attach` (serving shared sessions on a unix socket) and
:mod:`~corral.sessions.terminal` (the ``corral attach`` client on a real terminal).
"""
