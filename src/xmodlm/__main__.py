from xmodlm.cli import main

raise SystemExit(main())
