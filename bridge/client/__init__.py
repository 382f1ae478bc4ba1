"""`tes-bridge task`: a command-line client for any GA4GH TES 1.1 server.

It speaks plain JSON over HTTP (requests), so it neither needs this server's configuration nor
rejects fields another server adds. `api` holds the HTTP side, `cli` the commands, `watch` the
waiting (progress display, exit codes) and log following.
"""
