export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
W() { grep -v -E "Warning|_warn_once|warnings.warn|return cls.__new__|^W1130|^W1201|^W1202|^W1203|^W1204"; }
