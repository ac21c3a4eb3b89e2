"""The legorl web UI: a JSON API over run stores and the cluster, a packaged front end, static export.

`legorl ui` serves it (`legorl.ui.cli`); `legorl.ui.server.start_in_thread` serves it from another
process (`legorl run`); `legorl.ui.export` writes one self-contained HTML page of a run. Importing this
package loads nothing heavy.
"""
