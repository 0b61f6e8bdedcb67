/* LD_PRELOADed into the ASan runs (scripts/sanitize.sh): dlclose() does nothing, so the Open MPI
 * plug-ins (mca_*.so) are still mapped when LeakSanitizer runs at exit and the allocations they
 * keep by design can be matched by tests/sanitizers/lsan.supp by name. Unloaded, they show as
 * "<unknown module>" and could only be suppressed by suppressing everything. Test-only. */
int dlclose(void* handle) {
  (void)handle;
  return 0;
}
