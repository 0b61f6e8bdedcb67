"""End-to-end tests of locus-report (apps/locus-report), looked at as a person would: the page is
rendered in headless Chromium, which must decode every plot, and the numbers the page shows
are compared with the metrics file's.

- a real run: configs/tiny.ini trained for 378 steps (6 epochs) with checkpoints, its log and
  checkpoint directory, telemetry lines and a Prometheus file (train.prometheus);
- a real requeue: SIGTERM to one rank mid-run (exit 75), then --resume=auto;
- a hand-made metrics file with the line types of other parts of locus (event, ranks,
  telemetry with GPU figures, run lines) and a requeue: a resume after a gap of 20 minutes;
- bad input: a missing file, lines that are not JSON, a file without training lines, a bad
  command line, an unwritable output -- each a clear message, exit 2/3/5, no page written.
Args: BINDIR RANKS (the directory of locus-train and locus-report)."""
import base64
import html
import io
import json
import os
import re
import shutil
import subprocess


from apphelpers import check, expect_exit, main
from test_resume_app import BASE, sigterm_mid_run
from test_train_app import CONFIG, prepare

EXIT_CONFIG, EXIT_DATA, EXIT_IO = 2, 3, 5
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

# Appended to a copy of the page: once it has loaded, every image is decoded and measured and
# the outcome written into the DOM, which --dump-dom prints.
CHECKER = """<script>
window.addEventListener('load', () => {
  // Synchronous, inside the load event: drawing an image onto a canvas decodes it fully, and its
  // pixels tell a plot from a blank or broken image.
  const out = [...document.images].map(i => {
    const r = {id: i.id, complete: i.complete, w: i.naturalWidth, h: i.naturalHeight,
               inked: 0, colours: 0};
    try {
      const c = document.createElement('canvas');
      c.width = i.naturalWidth;
      c.height = i.naturalHeight;
      const g = c.getContext('2d');
      g.drawImage(i, 0, 0);
      const px = g.getImageData(0, 0, c.width, c.height).data;
      const seen = new Set();
      for (let k = 0; k < px.length; k += 4) {
        if (px[k] < 250 || px[k + 1] < 250 || px[k + 2] < 250) r.inked++;
        if (seen.size < 64) seen.add((px[k] << 16) | (px[k + 1] << 8) | px[k + 2]);
      }
      r.colours = seen.size;
      r.decoded = 'ok';
    } catch (e) {
      r.decoded = 'error: ' + e;
    }
    return r;
  });
  const pre = document.createElement('pre');
  pre.id = 'locus-test-images';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def report(r, *args, cwd=None):
    return subprocess.run(["/usr/bin/python3", os.path.join(r.bindir, "locus-report"), *args],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def browse(page, tmp):
    """The page as Chromium sees it: (its DOM after load, [{id, decoded, w, h}] per image);
    also takes a screenshot and checks that it is not blank."""
    check(CHROMIUM is not None, "chromium is not installed (scripts/install-deps.sh installs it)")
    text = open(page, encoding="utf-8").read()
    probe = os.path.join(tmp, "probe.html")
    with open(probe, "w", encoding="utf-8") as f:
        f.write(text.replace("</body>", CHECKER + "</body>"))
    flags = ["--headless", "--no-sandbox", "--disable-gpu",
             f"--user-data-dir={os.path.join(tmp, 'chromium-profile')}"]
    p = subprocess.run([CHROMIUM, *flags, "--dump-dom", "file://" + probe], capture_output=True,
                       text=True, timeout=120)
    check(p.returncode == 0 and "</html>" in p.stdout, "chromium --dump-dom failed", p)
    m = re.search(r'<pre id="locus-test-images">(.*?)</pre>', p.stdout, re.S)
    check(m is not None, "the checker never ran in Chromium (no load event?)", p)
    images = json.loads(html.unescape(m.group(1)))
    shot = os.path.join(tmp, "shot.png")
    p2 = subprocess.run([CHROMIUM, *flags, "--window-size=1200,2400", f"--screenshot={shot}",
                         "file://" + os.path.abspath(page)], capture_output=True, text=True,
                        timeout=120)
    check(p2.returncode == 0 and os.path.getsize(shot) > 0, "chromium --screenshot failed", p2)
    import matplotlib.image as mpimg  # noqa: PLC0415
    pixels = mpimg.imread(shot)
    check(pixels.std() > 0.05, f"the screenshot of {page} is blank (pixel std {pixels.std():.3f})")
    return p.stdout, images


def expect_plots(dom, images, names):
    ids = {i["id"]: i for i in images}
    for n in names:
        i = ids.get(f"plot-{n}")
        check(i is not None, f"no plot-{n} image in the page (images: {sorted(ids)})")
        check(i["decoded"] == "ok" and i["complete"] and i["w"] >= 200 and i["h"] >= 100,
              f"plot-{n} did not decode in Chromium to a real image: {i}")
        check(i["inked"] > 0.01 * i["w"] * i["h"] and i["colours"] >= 4,
              f"plot-{n} decodes to a blank picture in Chromium: {i}")
    for i in images:
        check(i["decoded"] == "ok", f"image {i} did not decode")
    # The PNGs themselves: not a blank canvas.
    import matplotlib.image as mpimg  # noqa: PLC0415
    for n in names:
        m = re.search(rf'id="plot-{n}"[^>]*src="data:image/png;base64,([^"]+)"', dom)
        pix = mpimg.imread(io.BytesIO(base64.b64decode(m.group(1))), format="png")
        check(pix.std() > 0.02, f"plot-{n} is a blank image")


def alt_of(dom, name):
    m = re.search(rf'id="plot-{name}"[^>]*alt="([^"]*)"', dom) or \
        re.search(rf'alt="([^"]*)"[^>]*id="plot-{name}"', dom)
    check(m is not None, f"plot-{name} has no alt text")
    return html.unescape(m.group(1))


def span(dom, ident):
    m = re.search(rf'<span id="{ident}"(?: data-value="([^"]*)")?>([^<]*)</span>', dom)
    check(m is not None, f"no #{ident} in the page")
    return html.unescape(m.group(1) or ""), html.unescape(m.group(2))


def metrics_lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]


def test_report_of_a_real_run(r, tmp):
    prepare(r, tmp)
    # An unwritable Prometheus path: exit 5 on every rank before anything is written.
    p = r.run("locus-train", "--config", CONFIG, "--train.prometheus=no/such/dir/job.prom",
              "--train.metrics=never.jsonl", cwd=tmp)
    expect_exit(p, EXIT_IO, "cannot write the Prometheus file 'no/such/dir/job.prom'",
                "set train.prometheus to a writable path")
    check(not os.path.exists(os.path.join(tmp, "never.jsonl")), "a refused run wrote metrics", p)
    p = r.run("locus-train", "--config", CONFIG, "--checkpoint.dir=ck",
              "--checkpoint.every_steps=100", "--checkpoint.keep_last=0",
              "--train.prometheus=job.prom", cwd=tmp)
    expect_exit(p, 0, "test accuracy")
    with open(os.path.join(tmp, "train.log"), "w") as f:
        f.write(p.stdout)
    lines = metrics_lines(os.path.join(tmp, "tiny-metrics.jsonl"))
    steps = [l for l in lines if l["type"] == "step"]
    epochs = [l for l in lines if l["type"] == "epoch"]
    check(len(steps) >= 30 and steps[-1]["step"] == 378, f"{len(steps)} step lines")
    for l in steps + epochs:
        check(isinstance(l.get("time"), float) and l["time"] > 1.6e9, f"no unix time in {l}")
    times = [l["time"] for l in lines]
    check(times == sorted(times), "the lines' times go backwards")

    q = report(r, "tiny-metrics.jsonl", "--log", "train.log", "--checkpoints", "ck",
               "-o", "rep/tiny.html", cwd=tmp)
    check(q.returncode == EXIT_IO, "a missing output directory must fail with exit 5", q)
    os.mkdir(os.path.join(tmp, "rep"))
    q = report(r, "tiny-metrics.jsonl", "--log", "train.log", "--checkpoints", "ck",
               "-o", "rep/tiny.html", cwd=tmp)
    expect_exit(q, 0)
    check(q.stdout.strip() == "rep/tiny.html", f"printed {q.stdout!r}, not the page's path", q)
    page = os.path.join(tmp, "rep", "tiny.html")
    dom, images = browse(page, tmp)
    expect_plots(dom, images, ["loss", "accuracy", "step-loss", "throughput", "data-wait",
                               "reduce", "timeline", "telemetry"])
    # The numbers: the final test accuracy and every epoch's, as the file has them.
    final = [l for l in epochs if "eval_accuracy" in l][-1]
    exact, shown = span(dom, "final-eval-accuracy")
    check(float(exact) == final["eval_accuracy"] and shown == f"{final['eval_accuracy']:.4f}",
          f"the page's final accuracy {shown} ({exact}) != the file's {final['eval_accuracy']}")
    check(f"final test accuracy {final['eval_accuracy']:.4f}" in alt_of(dom, "accuracy"),
          f"the accuracy plot does not carry the final accuracy: {alt_of(dom, 'accuracy')}")
    shown_epochs = [float(html.unescape(v)) for v in
                    re.findall(r'<span class="eval-accuracy" data-value="([^"]*)"', dom)]
    check(shown_epochs == [l["eval_accuracy"] for l in epochs],
          f"per-epoch accuracies {shown_epochs} != {[l['eval_accuracy'] for l in epochs]}")
    check(span(dom, "last-step")[1] == "378", "the page does not show the last step 378")
    check(span(dom, "restarts")[1] == "0", "an uninterrupted run shows restarts")
    # Checkpoints every 100 steps, at epoch ends and at the end: all on the timeline.
    ck_steps = sorted(int(s) for s in re.findall(r"ckpt-0*(\d+)\.h5", dom))
    for s in (100, 200, 300, 63, 378):
        check(s in ck_steps, f"checkpoint of step {s} missing from the page ({ck_steps})")
    # Telemetry of every rank, and the config and provenance of the run line.
    tel = [l for l in lines if l["type"] == "telemetry"]
    check(len(tel) >= 30 and all(len(l["rss_mib"]) == r.ranks for l in tel),
          f"{len(tel)} telemetry lines, expected one per log interval with {r.ranks} ranks")
    check(f"telemetry of {r.ranks} ranks" in alt_of(dom, "telemetry"), "telemetry plot's ranks")
    check("widths = 12,32,16,4" in html.unescape(dom), "the page lacks the effective config")
    check("git_revision" in dom and "world_size" in dom, "the page lacks the provenance")
    # The Prometheus file of the finished job (its format: test_telemetry's strict parser).
    prom = open(os.path.join(tmp, "job.prom")).read()
    for want in ('locus_train_running{locus_job="job"} 0\n', 'locus_train_step{locus_job="job"} 378\n',
                 '# TYPE locus_rank_cpu_seconds_total counter\n'):
        check(want in prom, f"job.prom lacks {want!r}:\n{prom}")
    for rank in range(r.ranks):
        check(re.search(rf'^locus_rank_resident_memory_bytes{{locus_job="job",rank="{rank}",host="[^"]+"}} '
                        r'[0-9.e+]+$', prom, re.M), f"job.prom lacks rank {rank}'s RSS:\n{prom}")


def test_report_of_a_requeued_run(r, tmp):
    """A real requeue: SIGTERM to one rank (checkpoint, exit 75), then --resume=auto appending to
    the same log: the page shows one restart at the checkpoint's step and both runs."""
    prepare(r, tmp)
    args = ("--checkpoint.dir=ck", "--train.metrics=rq.jsonl", "--train.output=")
    p1 = sigterm_mid_run(r, tmp, *args)
    expect_exit(p1, 75, "stopped by SIGTERM after step")
    stop = int(re.search(r"stopped by SIGTERM after step (\d+)", p1.stdout).group(1))
    p2 = r.run("locus-train", *BASE, *args, "--resume=auto", cwd=tmp)
    expect_exit(p2, 0, f"resumed from ck/ckpt-{stop:08d}.h5: step {stop} of 126")
    with open(os.path.join(tmp, "rq.log"), "w") as f:
        f.write(p1.stdout + p2.stdout)
    runs = [l for l in metrics_lines(os.path.join(tmp, "rq.jsonl")) if l["type"] == "run"]
    check([l["step"] for l in runs] == [0, stop], f"run lines at steps {[l['step'] for l in runs]}")
    check(runs[1]["resumed_from"] == f"ck/ckpt-{stop:08d}.h5", f"resumed_from {runs[1]}")
    # Nobody held the locks: taking them took milliseconds.
    check(all(0 <= l["lock_wait_s"] < 60 for l in runs), f"lock_wait_s of the runs: {runs}")
    q = report(r, "rq.jsonl", "--log", "rq.log", "--checkpoints", "ck", cwd=tmp)
    expect_exit(q, 0)
    dom, images = browse(os.path.join(tmp, "rq.report.html"), tmp)
    expect_plots(dom, images, ["loss", "accuracy", "timeline", "telemetry"])
    check(span(dom, "restarts")[1] == "1", "the requeue is not one restart in the page")
    check(re.search(rf"<h3>Restarts</h3>.*?<td>{stop}</td>.*?ck/ckpt-{stop:08d}\.h5", dom, re.S),
          f"the restarts table does not show the resume at step {stop}")
    check(re.search(r"<td>1</td><td>start</td><td>\d+</td><td>stopped by SIGTERM, exit 75</td>",
                    dom) and re.search(rf"<td>2</td><td>{stop}</td><td>\d+</td><td>finished</td>", dom),
          "the log's two runs are not in the page")
    check(span(dom, "last-step")[1] == "126", "the resumed run's last step is not shown")


def hand_made(path, ranks=4):
    """A 2-run job as its metrics file reads: run 1 trains to step 100 (a checkpoint; whatever it
    wrote after it, the resumed run dropped), the job is down 20 minutes, run 2 resumes at 100
    and ends at 240; rank 2 straggles from step 140 to 200; one loss anomaly."""
    t0, out = 1.75e9, []

    def put(**kv):
        out.append(json.dumps(kv))
    put(type="run", step=0, time=t0, world_size=ranks, host="n0", hosts=["n0", "n0", "n1", "n1"],
        tool_version="0.1.0", git_revision="abc123", config="[train]\nepochs = 2\n")
    acc = [0.61, 0.7312]
    t = t0
    for step in range(10, 241, 10):
        if step == 110:
            t += 1200  # down: the job was requeued
            put(type="run", step=100, time=t, world_size=ranks, host="n0",
                hosts=["n0", "n0", "n1", "n1"], resumed_from="ck/ckpt-00000100.h5",
                lock_wait_s=95.25,
                tool_version="0.1.0", git_revision="abc123", config="[train]\nepochs = 2\n")
        t += 2.0
        put(type="step", step=step, epoch=step // 120, step_in_epoch=step % 120, steps=10,
            samples=1280, loss=2.0 / (1 + step / 50), accuracy=min(0.9, step / 250), lr=0.05,
            seconds=2.0, samples_per_s=640.0, allreduce_s=0.2, allreduce_blocked_s=0.05,
            hidden_fraction=0.75, data_wait_s=0.1, data_wait_fraction=0.05, time=t)
        slow = 4.0 if 140 <= step < 200 else 1.0
        put(type="ranks", step=step, time=t, compute_s=[0.01, 0.0105, 0.01 * slow, 0.0098],
            data_wait_s=[0.001] * ranks, reduce_wait_s=[0.03, 0.03, 0.001, 0.03],
            pipeline_wait_s=[0.0] * ranks, step_max_s=[0.02, 0.021, 0.02 * slow, 0.019])
        put(type="telemetry", step=step, time=t, rss_mib=[300.0 + step / 10] * ranks,
            rss_peak_mib=[310.0 + step / 10] * ranks, cpu_s=[step * 0.2] * ranks,
            minor_faults=[1000 + step] * ranks, major_faults=[step // 50] * ranks,
            read_bytes=[step * 1e6] * ranks, write_bytes=[step * 1e5] * ranks,
            gpu_util_pct=[90.0, 91.0, 40.0, 92.0], gpu_mem_used_mib=[20000.0] * ranks,
            gpu_mem_total_mib=[81559.0] * ranks, gpu_power_w=[500.0, 510.0, 200.0, 505.0],
            gpu_temp_c=[60.0] * ranks, gpu_sm_clock_mhz=[1980.0] * ranks,
            gpu_mem_clock_mhz=[2619.0] * ranks)
        if step == 140:
            put(type="event", step=step, event="straggler", time=t, rank=2, host="n1",
                node="n1", part="compute", ratio=4.0)
        if step == 200:
            put(type="event", step=step, event="straggler_recovered", time=t, rank=2,
                host="n1", node="n1", part="compute", ratio=1.0)
        if step == 50:
            put(type="event", step=step, event="anomaly", time=t, loss=9.5, z=7.2,
                grad_norm=40.0)
        if step in (120, 240):
            e = step // 120 - 1
            put(type="epoch", epoch=e, step=step, samples=15360, train_loss=1.0 / (e + 1),
                train_accuracy=0.5 + 0.2 * e, seconds=24.0, samples_per_s=640.0,
                data_wait_fraction=0.05, hidden_fraction=0.75, eval_rows=500,
                eval_loss=0.9 - 0.2 * e, eval_accuracy=acc[e], eval_seconds=0.5, time=t + 0.5)
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return [json.loads(l) for l in out], acc


def test_report_hand_made(r, tmp):
    path = os.path.join(tmp, "job.jsonl")
    _, acc = hand_made(path)
    q = report(r, path)
    expect_exit(q, 0)
    page = os.path.join(tmp, "job.report.html")
    check(q.stdout.strip() == page, f"printed {q.stdout!r}", q)
    dom, images = browse(page, tmp)
    expect_plots(dom, images, ["loss", "accuracy", "throughput", "data-wait", "reduce",
                               "timeline", "ranks", "ranks-last", "telemetry"])
    exact, shown = span(dom, "final-eval-accuracy")
    check(shown == "0.7312" and float(exact) == acc[-1], f"final accuracy shown {shown}")
    check(span(dom, "restarts")[1] == "1", "the requeue is not counted as one restart")
    check("resumed at step" in dom and re.search(r"<td>100</td><td>[^<]*</td><td>20\.0</td>", dom),
          "the restarts table does not show the resume at step 100 after 20.0 minutes down")
    check(re.search(r"<td>20\.0</td><td>95\.2</td>", dom) and "taking the locks (s)" in dom,
          "the restarts table does not show the 95.25 s the resumed run took to take its locks")
    check("1 restarts" in alt_of(dom, "timeline"), alt_of(dom, "timeline"))
    check("stragglers: rank 2" in alt_of(dom, "ranks"), alt_of(dom, "ranks"))
    check(span(dom, "events")[1] == "3", "the page does not count the 3 events")
    names = re.findall(r'<span class="event-name">([^<]*)</span>', dom)
    check(names == ["anomaly", "straggler", "straggler_recovered"], f"events shown: {names}")
    check("ratio=4.0" in dom and "z=7.2" in dom, "the events' values are not shown")
    check("n0: ranks 0-1; n1: ranks 2-3" in dom, "the hosts of the ranks are not shown")
    check("resumed_from" in dom and "ck/ckpt-00000100.h5" in dom, "the resume's checkpoint")
    check(re.search(r"<td>2</td><td>[^<]*</td><td>[^<]*</td><td>[^<]*</td><td>[^<]*</td>"
                    r"<td>[^<]*</td><td>[^<]*</td><td>40</td><td>20000</td><td>200</td>", dom),
          "the telemetry table does not show rank 2's GPU figures")
    # Unknown line types (a newer locus) are counted, not fatal.
    with open(path, "a") as f:
        f.write('{"type":"future","step":240,"time":1.0}\n')
    expect_exit(report(r, path, "-o", os.path.join(tmp, "b.html")), 0)
    check("future (1)" in open(os.path.join(tmp, "b.html")).read(), "unknown types not listed")


def test_report_bad_input(r, tmp):
    out = os.path.join(tmp, "x.html")

    def refused(args, code, *needles):
        q = report(r, *args, "-o", out, cwd=tmp)
        expect_exit(q, code, *needles)
        check(q.stdout == "" and not os.path.exists(out) and
              not [f for f in os.listdir(tmp) if f.endswith(".tmp")],
              f"a refused run wrote something: {os.listdir(tmp)}", q)
    refused(["missing.jsonl"], EXIT_DATA, "cannot read the metrics file 'missing.jsonl'")
    with open(os.path.join(tmp, "bad.jsonl"), "w") as f:
        f.write('{"type":"step","step":10,"time":1.0}\nthis is not json\n{"type":"step"}\n')
    refused(["bad.jsonl"], EXIT_DATA, "bad.jsonl:2: not a JSON object")
    with open(os.path.join(tmp, "arr.jsonl"), "w") as f:
        f.write('[1, 2]\n')
    refused(["arr.jsonl"], EXIT_DATA, "arr.jsonl:1:", "\"type\" member")
    with open(os.path.join(tmp, "none.jsonl"), "w") as f:
        f.write('{"type":"telemetry","step":10,"time":1.0,"rss_mib":[1.0]}\n')
    refused(["none.jsonl"], EXIT_DATA, "no \"step\" or \"epoch\" line")
    with open(os.path.join(tmp, "bin.jsonl"), "wb") as f:
        f.write(b'{"type":"step"}\n\xff\xfe\n')
    refused(["bin.jsonl"], EXIT_DATA, "bin.jsonl:2: not UTF-8")
    good = os.path.join(tmp, "good.jsonl")
    hand_made(good)
    refused([good, "--log", "nolog.txt"], EXIT_DATA, "cannot read the training log 'nolog.txt'")
    refused([good, "--checkpoints", "nodir"], EXIT_DATA, "checkpoint directory 'nodir'")
    with open(os.path.join(tmp, "notalog.txt"), "w") as f:
        f.write("hello\n")
    refused([good, "--log", "notalog.txt"], EXIT_DATA, "not a locus-train log")
    refused([good, "--bogus"], EXIT_CONFIG, "unrecognized arguments: --bogus")
    q = report(r, cwd=tmp)
    expect_exit(q, EXIT_CONFIG, "the following arguments are required: metrics")
    # A torn last line (a job killed mid-write) is tolerated, with a note.
    with open(good, "a") as f:
        f.write('{"type":"step","step":250,"epo')
    q = report(r, good, "-o", out, cwd=tmp)
    expect_exit(q, 0, "the last line is incomplete")


if __name__ == "__main__":
    main([test_report_of_a_real_run, test_report_of_a_requeued_run, test_report_hand_made],
         once=[test_report_bad_input])
