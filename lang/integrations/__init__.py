"""`plait.integrations`: plait under the engines platform teams run (Ray Serve), by the names the deployment
docs use (`docs/deploy.md`). The code lives in `plait.runtime.integrations`; these modules only hand it on."""
