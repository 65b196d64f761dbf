//! The web dashboard of a running testnet node: its guards over plain HTTP (no token, no
//! session, another origin, no CSRF token: each refused), and the page itself in headless
//! Chromium driven through chromedriver's WebDriver API: it logs in, sees a published job
//! appear and change state without reloading, presses pause and confirms, and the node
//! reports paused. A screenshot is kept as a test artifact.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cannabis_api::NodeInfo;
use serde_json::{Value, json};

use super::settle::{cannabis, client};

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(30)))
        .http_status_as_error(false)
        .max_redirects(0)
        .build()
        .into()
}

fn api_of(node: &Path) -> String {
    NodeInfo::read(node).unwrap().api.unwrap()
}

fn token_of(node: &Path) -> String {
    std::fs::read_to_string(node.join("api.token"))
        .unwrap()
        .trim()
        .to_string()
}

/// Logs in with `token` (from the page's own origin); the session cookie, if one was set.
fn login(api: &str, token: &str, origin: &str) -> (u16, Option<String>) {
    let r = agent()
        .post(format!("http://{api}/ui/login"))
        .header("Origin", origin)
        .content_type("application/x-www-form-urlencoded")
        .send(format!("token={token}"))
        .unwrap();
    let cookie = r
        .headers()
        .get("set-cookie")
        .map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), cookie)
}

#[test]
fn the_dashboard_refuses_requests_without_the_token_a_session_or_its_own_origin() {
    let dir = tempfile::tempdir().unwrap();
    let net = super::testnet::Testnet::up(&dir.path().join("net"), 1);
    let node = &net.nodes()[0];
    let api = api_of(node);
    let token = token_of(node);
    let own = format!("http://{api}");
    let a = agent();

    // Nothing without a token or a session: the page sends to the login, the API refuses.
    let r = a.get(format!("http://{api}/ui/")).call().unwrap();
    assert_eq!(r.status().as_u16(), 303);
    assert_eq!(r.headers()["location"], "/ui/login");
    for path in ["/v1/status", "/ui/events", "/v1/jobs"] {
        let r = a.get(format!("http://{api}{path}")).call().unwrap();
        assert_eq!(r.status().as_u16(), 401, "{path}");
    }
    // A wrong token, or the right one posted from another origin, opens no session.
    assert_eq!(login(&api, "0123", &own), (401, None));
    assert_eq!(login(&api, &token, "http://evil.example"), (403, None));
    let r = agent()
        .post(format!("http://{api}/ui/login"))
        .header("Origin", "http://evil.example\"><script>alert(1)</script>")
        .content_type("application/x-www-form-urlencoded")
        .send(format!("token={token}"))
        .unwrap();
    let page = r.into_body().read_to_string().unwrap();
    assert!(
        !page.contains("<script>alert"),
        "the origin is escaped: {page}"
    );

    // The right token from the page's origin: a cookie no script reads and no other site
    // sends.
    let (status, cookie) = login(&api, &token, &own);
    assert_eq!(status, 303);
    let cookie = cookie.unwrap();
    for want in ["cannabis_session=", "HttpOnly", "SameSite=Strict", "Path=/"] {
        assert!(cookie.contains(want), "{want} not in {cookie}");
    }
    let session = cookie.split(';').next().unwrap().to_string();
    let page = a
        .get(format!("http://{api}/ui/"))
        .header("Cookie", &session)
        .call()
        .unwrap();
    assert_eq!(page.status().as_u16(), 200);
    let policy = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(policy.contains("script-src 'self'") && policy.contains("frame-ancestors 'none'"));
    let html = page.into_body().read_to_string().unwrap();
    let csrf = html
        .split("name=\"csrf\" content=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap()
        .to_string();
    assert_eq!(csrf.len(), 64);
    assert!(!html.contains(&token), "the token is never in the page");

    // Reads with the session; not from another origin.
    let get = |origin: Option<&str>| {
        let mut r = a
            .get(format!("http://{api}/v1/status"))
            .header("Cookie", &session);
        if let Some(o) = origin {
            r = r.header("Origin", o);
        }
        r.call().unwrap().status().as_u16()
    };
    assert_eq!(get(None), 200);
    assert_eq!(get(Some(&own)), 200);
    assert_eq!(get(Some("http://evil.example")), 403);

    // Changes need the CSRF token and the page's origin as well.
    let control = |origin: Option<&str>, csrf: Option<&str>| {
        let mut r = a
            .post(format!("http://{api}/v1/exec/control"))
            .header("Cookie", &session);
        if let Some(o) = origin {
            r = r.header("Origin", o);
        }
        if let Some(c) = csrf {
            r = r.header("X-CSRF-Token", c);
        }
        r.send_json(json!({"control": "active"}))
            .unwrap()
            .status()
            .as_u16()
    };
    assert_eq!(control(Some(&own), None), 403);
    assert_eq!(control(Some(&own), Some("0".repeat(64).as_str())), 403);
    assert_eq!(control(Some("http://evil.example"), Some(&csrf)), 403);
    assert_eq!(control(None, Some(&csrf)), 403);
    let ok = control(Some(&own), Some(&csrf));
    // 200, or 503 where this machine gives the node no executor: past the guards either way.
    assert!(ok == 200 || ok == 503, "{ok}");

    // Logging out ends the session.
    let r = a
        .post(format!("http://{api}/ui/logout"))
        .header("Cookie", &session)
        .header("Origin", &own)
        .header("X-CSRF-Token", &csrf)
        .send_empty()
        .unwrap();
    assert_eq!(r.status().as_u16(), 303);
    assert_eq!(get(None), 401);
    drop(net);
}

/// An open dashboard (its event stream, which never ends by itself, and the browser's
/// idle connections) does not hold its node up: on SIGTERM the node stops at once instead
/// of waiting out its 5 s bound for the handles those connections held.
#[test]
fn a_node_with_its_dashboard_open_stops_without_waiting_for_it() {
    use std::io::Read as _;
    let dir = tempfile::tempdir().unwrap();
    let net = super::testnet::Testnet::up(&dir.path().join("net"), 1);
    let node = net.nodes()[0].clone();
    let api = api_of(&node);
    let own = format!("http://{api}");
    let (_, cookie) = login(&api, &token_of(&node), &own);
    let session = cookie.unwrap().split(';').next().unwrap().to_string();
    let a = agent();
    // An idle keep-alive connection, and an event stream read until it ends.
    let r = a
        .get(format!("http://{api}/v1/status"))
        .header("Cookie", &session)
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let events = a
        .get(format!("http://{api}/ui/events"))
        .header("Cookie", &session)
        .call()
        .unwrap();
    assert_eq!(events.status().as_u16(), 200);
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = events.into_body().into_reader().read_to_string(&mut text);
        text
    });
    std::thread::sleep(Duration::from_millis(1500));
    let record: Value =
        serde_json::from_str(&std::fs::read_to_string(net.dir.join("testnet.json")).unwrap())
            .unwrap();
    let pid = record["nodes"][0]["pid"].as_u64().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    // Gone, or a zombie its parent (`testnet up`) has yet to reap.
    let alive = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next())
                != Some("Z")
        })
    };
    let until = Instant::now() + Duration::from_secs(20);
    while alive(pid) {
        assert!(Instant::now() < until, "the node did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = reader.join().unwrap();
    assert!(text.contains("event: pulse"), "{text}");
    let log = std::fs::read_to_string(node.join("node.log")).unwrap();
    assert!(log.contains("stopping"), "{log}");
    assert!(
        !log.contains("did not stop within"),
        "the node waited for its dashboard's connections: {log}"
    );
    assert!(
        !node.join("node.json").exists(),
        "a clean stop removes node.json"
    );
    drop(net);
}

/// Where a program is on `PATH`.
fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

/// chromedriver on a free port, killed when dropped.
struct Driver {
    child: Child,
    base: String,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

impl Driver {
    fn start(driver: &Path) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let d = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
        };
        let until = Instant::now() + Duration::from_secs(30);
        while d.call("GET", "/status", None).get("ready") != Some(&Value::Bool(true)) {
            assert!(Instant::now() < until, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    /// One WebDriver command: its `value`, or `null` when the driver is not answering.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}{path}", self.base);
        let a = agent();
        let r = match (method, body) {
            ("GET", _) => a.get(&url).call(),
            ("DELETE", _) => a.delete(&url).call(),
            (_, Some(b)) => a.post(&url).send_json(b),
            (_, None) => a.post(&url).send_json(json!({})),
        };
        match r {
            Ok(r) => {
                let v: Value = r.into_body().read_json().unwrap_or(Value::Null);
                v.get("value").cloned().unwrap_or(Value::Null)
            }
            Err(_) => Value::Null,
        }
    }
}

struct Browser<'a> {
    driver: &'a Driver,
    id: String,
}

impl<'a> Browser<'a> {
    fn open(driver: &'a Driver, chromium: &Path) -> Self {
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,1800"]
            }
        }}});
        let v = driver.call("POST", "/session", Some(caps));
        let id = v["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {v}"))
            .to_string();
        Self { driver, id }
    }

    fn cmd(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.driver
            .call(method, &format!("/session/{}{path}", self.id), body)
    }

    fn goto(&self, url: &str) {
        self.cmd("POST", "/url", Some(json!({ "url": url })));
    }

    fn find(&self, css: &str) -> Option<String> {
        let v = self.cmd(
            "POST",
            "/element",
            Some(json!({"using": "css selector", "value": css})),
        );
        v.get(ELEMENT).and_then(Value::as_str).map(str::to_string)
    }

    fn text(&self, css: &str) -> String {
        self.find(css)
            .map(|e| {
                self.cmd("GET", &format!("/element/{e}/text"), None)
                    .as_str()
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap_or_default()
    }

    fn click(&self, css: &str) {
        let e = self.find(css).unwrap_or_else(|| panic!("no {css}"));
        self.cmd("POST", &format!("/element/{e}/click"), None);
    }

    fn type_into(&self, css: &str, text: &str) {
        let e = self.find(css).unwrap_or_else(|| panic!("no {css}"));
        self.cmd(
            "POST",
            &format!("/element/{e}/value"),
            Some(json!({ "text": text })),
        );
    }

    fn script(&self, script: &str) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
    }

    /// Waits up to `secs` for `done`, saying `what` when it does not come.
    fn wait(&self, secs: u64, what: &str, done: impl Fn(&Self) -> bool) {
        let until = Instant::now() + Duration::from_secs(secs);
        while !done(self) {
            assert!(
                Instant::now() < until,
                "waited {secs} s for {what}; the page: {}",
                self.text("main")
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn screenshot(&self, to: &Path) {
        use base64::Engine as _;
        let png = self.cmd("GET", "/screenshot", None);
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap())
            .unwrap();
        std::fs::write(to, bytes).unwrap();
    }
}

impl Drop for Browser<'_> {
    fn drop(&mut self) {
        self.cmd("DELETE", "", None);
    }
}

#[test]
fn in_a_browser_the_dashboard_logs_in_follows_a_job_live_and_pauses_the_node() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: jobs run only where the executor is root");
        return;
    }
    let (Some(driver), Some(chromium)) = (
        which("chromedriver"),
        which("chromium").or_else(|| which("chromium-browser")),
    ) else {
        eprintln!("skipped: needs chromium and chromedriver (Debian: chromium chromium-driver)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let net = super::testnet::Testnet::up(&dir.path().join("net"), 2);
    let nodes = net.nodes();
    // Node 0 (half a core) publishes; node 1 runs the job.
    let node = &nodes[0];
    let api = api_of(node);
    let address = client(node).status().unwrap().address;
    super::testnet::wait_for_workers(node, 1);

    let driver = Driver::start(&driver);
    let b = Browser::open(&driver, &chromium);
    b.goto(&format!("http://{api}/ui/"));
    b.wait(10, "the login page", |b| b.find("#token").is_some());
    b.type_into("#token", &token_of(node));
    b.click("#login");
    b.wait(20, "the node's address on the page", |b| {
        b.text("#node-address") == address
    });
    assert_eq!(b.text("#live"), "live");
    let loaded = b.script("return window.cannabisLoadedAt;");
    // No token in the address bar or anywhere the page can reach.
    let url = b.cmd("GET", "/url", None);
    assert!(!url.as_str().unwrap().contains(&token_of(node)), "{url}");
    assert_eq!(b.script("return document.cookie;"), json!(""));

    // A job published from the CLI appears and runs to completion on the open page.
    let file = dir.path().join("job.toml");
    std::fs::write(
        &file,
        "name = \"watched\"\ndeadline = \"5m\"\nbid_window = \"2s\"\nreview_window = \"5m\"\n\
         [[task]]\nname = \"watched\"\nbudget = 100_000\n[task.workload]\nadapter = \"synthetic\"\n\
         entrypoint = [\"64\"]\n[task.resources]\ncpu = 1\nmemory = \"256MiB\"\nstorage = \"16MiB\"\n",
    )
    .unwrap();
    let o = cannabis(
        node,
        &["job", "submit", file.to_str().unwrap(), "--yes", "--json"],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let id = serde_json::from_slice::<Value>(&o.stdout).unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_string();
    let state = |b: &Browser<'_>| {
        b.script(&format!(
            "const r = document.getElementById('job-{id}'); return r ? r.dataset.state : null;"
        ))
    };
    b.wait(20, "the job on the page", |b| state(b).is_string());
    b.wait(90, "the job completed on the page", |b| {
        state(b) == json!("completed")
    });
    assert_eq!(
        b.script("return window.cannabisLoadedAt;"),
        loaded,
        "the page was not reloaded"
    );
    // Its timeline, on a click.
    b.click(&format!("#job-{id}"));
    b.wait(10, "the job's timeline", |b| {
        b.text("#job-history").contains("task done")
    });
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    b.screenshot(&shot);
    assert!(std::fs::metadata(&shot).unwrap().len() > 10_000);
    eprintln!("screenshot: {}", shot.display());

    // Pause, confirmed in the browser's dialog: the node reports paused.
    b.click("#control-pause");
    b.cmd("POST", "/alert/accept", None);
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let exec: Value = client(node).get("/v1/exec").unwrap();
        if exec["control"] == json!("paused") {
            break;
        }
        assert!(Instant::now() < until, "the node is not paused: {exec}");
        std::thread::sleep(Duration::from_millis(200));
    }
    b.wait(10, "paused on the page", |b| {
        b.text("#node-control") == "paused"
    });
    drop(b);
    drop(driver);
    drop(net);
}
