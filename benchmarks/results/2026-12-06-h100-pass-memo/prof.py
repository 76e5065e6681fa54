"""cProfile around the optimize_time probe: python dev/prof.py OUTFILE N -- probe args"""
import cProfile, pstats, sys, io, os
sys.path.insert(0, os.getcwd())
out, n = sys.argv[1], int(sys.argv[2])
sys.argv = ["optimize_time"] + sys.argv[4:]
from benchmarks.probes import optimize_time
prof = cProfile.Profile()
prof.enable()
try:
    optimize_time.main()
finally:
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats("kopt/", n)
    st.sort_stats("tottime").print_stats(n // 2)
    open(out, "w").write(s.getvalue())
